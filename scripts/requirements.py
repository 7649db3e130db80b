"""Print pyproject.toml's requirements, one a line, for `pip install -r`: the core dependencies (unless --no-core)
plus the named extras. The Dockerfile installs them before it copies the sources, so a code change keeps the
dependency layers; the list itself lives only in pyproject.toml.

    python scripts/requirements.py server operator      # the serving image
    python scripts/requirements.py --no-core operator   # the operator image: no torch
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str], core: bool = True) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extra(s) {', '.join(unknown)}; pyproject.toml has {', '.join(optional)}")
    out = list(project["dependencies"]) if core else []
    for extra in extras:
        out += [r for r in optional[extra] if r not in out]
    return out


def default_pyproject() -> Path:
    """pyproject.toml beside this script (the Dockerfile copies both into /src), else the repository root's."""
    here = Path(__file__).resolve().parent
    beside = here / "pyproject.toml"
    return beside if beside.exists() else here.parent / "pyproject.toml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("extras", nargs="*")
    p.add_argument("--no-core", action="store_true", help="leave out [project] dependencies (torch among them)")
    p.add_argument("--pyproject", type=Path, default=default_pyproject())
    args = p.parse_args(argv)
    print("\n".join(requirements(args.pyproject, args.extras, core=not args.no_core)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
