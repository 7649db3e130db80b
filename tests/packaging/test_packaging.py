"""Packaging: one version, a license, pinned installs, `inferscale --version`, a torch-free operator (its import
closure, and the Dockerfile's `operator` target), dependencies installed before sources are copied."""

from __future__ import annotations

import fnmatch
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import inferscale
from inferscale.kernels.cppext import local_headers

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SOURCE_DIRS = ("inferscale/", "kernels/", "server/", "operator/")
# Model code: none of it may load in the operator's process (its image has no torch).
HEAVY = ("torch", "transformers", "safetensors", "sentence_transformers", "numpy", "nixl", "fastapi")


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONSAFEPATH": "1", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_version_is_written_once():
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "inferscale.__version__"}
    assert md.version("inferscale") == inferscale.__version__
    chart = yaml.safe_load((ROOT / "charts" / "inferscale" / "Chart.yaml").read_text())
    assert chart["appVersion"] == inferscale.__version__
    # No other file states it: the server's OpenAPI version comes from the package too.
    for path in ("server/app.py", "inferscale/cli.py", "operator/cli.py"):
        assert not re.search(r"[\"']\d+\.\d+\.\d+[\"']", (ROOT / path).read_text()), path


def test_cli_version():
    out = _run("-m", "inferscale.cli", "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"inferscale {inferscale.__version__}"


@pytest.mark.parametrize("argv", [["-v", "operator", "--help"], ["--verbose", "operator", "--help"],
                                  ["operator", "--help"]])
def test_verbose_operator_runs_without_traceback(argv):
    out = _run("-m", "inferscale.cli", *argv)
    assert out.returncode == 0, out.stderr
    assert "usage: inferscale operator" in out.stdout and "Traceback" not in out.stderr


def test_verbose_reaches_the_operator():
    from inferscale import cli

    seen = []
    import inferscale.operator.cli as op

    real = op.main
    op.main = lambda argv: seen.append(argv) or 0
    try:
        assert cli.main(["-v", "operator", "-n", "acme"]) == 0
    finally:
        op.main = real
    assert seen == [["--verbose", "-n", "acme"]]


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert md.metadata("inferscale")["License-Expression"] == "Apache-2.0"


def _requirements() -> list[Requirement]:
    reqs = list(PYPROJECT["project"]["dependencies"])
    for extra in PYPROJECT["project"]["optional-dependencies"].values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def test_fragile_dependencies_have_upper_bounds():
    by_name = {canonicalize_name(r.name): r for r in _requirements()}
    assert by_name["transformers"].specifier == Requirement("x>=5.0,<6").specifier
    for name in ("torch", "fastapi", "pydantic", "kopf", "opentelemetry-sdk", "opentelemetry-instrumentation-fastapi"):
        assert any(s.operator in ("<", "==") for s in by_name[name].specifier), name


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and "+" not in version, line  # exact pins, no local build tag (+cpu)
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_every_requirement_within_its_range():
    pins = _constraints()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])
    assert "inferscale" not in pins
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-c constraints.txt" in setup  # the project with its extras, torch included, installs under the pins
    assert "torch==" not in setup  # the torch pin lives in constraints.txt only


def test_operator_imports_without_torch():
    """The operator extra's import closure: with model code blocked, the operator's modules and its CLI load."""
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in HEAVY)
    code = (f"import sys; {blocked}\n"
            "import inferscale.operator.cli, inferscale.operator.handlers, inferscale.operator.reconcile\n"
            "from inferscale.cli import main\n"
            "sys.exit(main(['-v', 'operator', '--help']))")
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr
    assert "usage: inferscale operator" in out.stdout


def test_blocking_really_blocks():
    """Control for the test above: the same blocking makes a torch import fail."""
    out = _run("-c", "import sys; sys.modules['torch'] = None\nimport inferscale.engine")
    assert out.returncode != 0 and "torch" in out.stderr


def _stages() -> dict[str, list[dict]]:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    stages: dict[str, list[dict]] = {}
    current: list[dict] = []
    for ins in parser.structure:
        if ins["instruction"] == "FROM":
            name = ins["value"].split()[-1] if " AS " in ins["value"].upper() else ins["value"]
            current = stages.setdefault(name.lower(), [])
        current.append(ins)
    return stages


def _chain(stages: dict[str, list[dict]], name: str) -> list[dict]:
    """A stage's instructions with those of the stages it is built FROM, base first."""
    own = stages[name]
    parent = own[0]["value"].split()[0].lower()
    return (_chain(stages, parent) if parent in stages else []) + own


def _copies_sources(ins: dict) -> bool:
    """A COPY of the package's sources: from the build context, or from the ``sources`` stage that holds them."""
    words = ins["value"].split()
    return ins["instruction"] == "COPY" and ("--from=sources" in words or any(d in words for d in SOURCE_DIRS))


@pytest.mark.parametrize("target", ["operator", "server"])
def test_dockerfile_installs_dependencies_before_copying_sources(target):
    chain = _chain(_stages(), target)
    first_source = next(i for i, ins in enumerate(chain) if _copies_sources(ins))
    dep_installs = [i for i, ins in enumerate(chain) if ins["instruction"] == "RUN" and "-r /tmp/requirements.txt" in ins["value"]]
    assert dep_installs and max(dep_installs) < first_source
    # Every pip install is pinned by constraints.txt, except the project itself (--no-deps: nothing to resolve)
    # and the GPU build's torch (its version is the fleet's choice).
    for ins in chain:
        for cmd in re.findall(r"pip install[^;&|]*", ins["value"]):
            assert "-c " in cmd or "--no-deps" in cmd or "torch>=" in cmd, cmd
    after = [ins for ins in chain[first_source:] if ins["instruction"] == "RUN" and "pip install" in ins["value"]]
    assert after and all("--no-deps" in ins["value"] for ins in after)


def test_dockerfile_operator_target_has_no_torch():
    stages = _stages()
    assert {"operator", "server"} <= set(stages)
    chain = _chain(stages, "operator")
    runs = " ".join(ins["value"] for ins in chain if ins["instruction"] == "RUN")
    assert "torch" not in runs and "--no-core operator" in runs and "load_model" not in runs
    entry = [ins["value"] for ins in chain if ins["instruction"] in ("CMD", "USER")]
    assert '["operator"]' in entry and "10001:10001" in entry
    # What the operator stage installs is exactly the operator extra: no torch in it.
    sys.path.insert(0, str(ROOT / "scripts"))
    from requirements import requirements

    reqs = [canonicalize_name(Requirement(r).name) for r in requirements(ROOT / "pyproject.toml", ["operator"], core=False)]
    assert "torch" not in reqs and "kopf" in reqs
    # The default target (a plain `docker build .`) stays the serving image.
    assert list(stages)[-1] == "server"


def test_dockerfile_server_target_builds_the_kernels_into_the_image():
    """The serving image compiles the CPU kernels when it is made (its model step loads them, and they build) and
    keeps the compiler for a CPU it was not built on: pods run with a read-only root filesystem (cppext.py)."""
    runs = [ins["value"] for ins in _chain(_stages(), "server") if ins["instruction"] == "RUN"]
    compiler = next(i for i, run in enumerate(runs) if "g++" in run and "ninja-build" in run)
    model = next(i for i, run in enumerate(runs) if "load_model()" in run)
    assert compiler < model
    assert "python -m inferscale.kernels" in runs[model]  # every kernel this CPU runs, not only the model's
    assert "INFERSCALE_CACHE_DIR" in runs[model]  # the cache the pods read is the one the model step fills


def _docker_ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore's rule: the last pattern matching the path or a parent directory decides; '!' re-includes."""
    ignored = False
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/").removeprefix("**/")
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p.split("/")[-1], pat) for p in prefixes):
            ignored = not negate
    return ignored


def test_nothing_the_dockerfile_copies_is_dockerignored():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert _docker_ignored("tests/test_x.py", patterns) and _docker_ignored("scripts/setup.sh", patterns)  # control
    copied = []
    for ins in DockerfileParser(path=str(ROOT / "Dockerfile")).structure:
        if ins["instruction"] == "COPY" and not ins["value"].startswith("--from="):  # not another stage's files
            copied += ins["value"].split()[:-1]
    assert "scripts/requirements.py" in copied and "constraints.txt" in copied
    for src in copied:
        assert (ROOT / src).exists(), src
        assert not _docker_ignored(src, patterns), f"{src} is excluded by .dockerignore"


def test_installed_package_carries_every_kernel_source_and_header():
    """A non-editable install (the Dockerfile's ``pip install .``) gets the package data only: a kernel whose
    ``#include "x.h"`` is left out fails to build there, and serving falls back to aten's slower operations."""
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["inferscale.kernels"]
    sources = sorted((ROOT / "kernels").glob("*.cpp"))
    headers = {h for src in sources for h in local_headers(src)}  # what each kernel's build reads (cppext.py)
    assert sources and "greedy_screen.h" in headers  # control: what this test reads is there
    for name in [src.name for src in sources] + sorted(headers):
        assert (ROOT / "kernels" / name).is_file(), name
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), f"{name} is not in the package data"


def test_readme_names_the_build_targets():
    readme = (ROOT / "README.md").read_text()
    assert "docker build --target operator" in readme and "docker build --target server" in readme


def test_requirements_script_runs_where_the_dockerfile_puts_it(tmp_path):
    """The Dockerfile copies scripts/requirements.py beside pyproject.toml into /src and runs it there."""
    import shutil
    import subprocess
    import sys

    for name in ("pyproject.toml", "scripts/requirements.py"):
        shutil.copy(ROOT / name, tmp_path / Path(name).name)
    out = subprocess.run([sys.executable, "requirements.py", "--no-core", "operator"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out and all("torch" not in r for r in out) and any(r.startswith("kopf") for r in out)
