"""Build (once) and find the real control plane's binary: kube-apiserver, kube-controller-manager, kube-scheduler
and etcd in one multi-call Go binary (e2e/k8s-build), compiled from the Go module proxy.

The binary is cached at ``$XDG_CACHE_HOME/inferscale/k8s/<k8s version>-<hash of the wrapper module>/inferscale-k8s``
(else ``~/.cache/...``): a second run finds it and starts in seconds; changing the version or the wrapper builds a new
one next to it. The Go build cache (GOCACHE, Go's default) makes a rebuild after a small change quick too.

CLI: ``python e2e/controlplane_build.py [path|build]`` -- `path` prints where the binary is (exit 1 when absent),
`build` builds it when absent and prints the path and the build's wall time.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODULE = Path(__file__).resolve().parent / "k8s-build"
NAME = "inferscale-k8s"
GO_FILES = ("go.mod", "go.sum", "main.go")


class ControlPlaneUnavailable(RuntimeError):
    """The control-plane binary is not built and cannot be built here; the message says why and what to do."""


def k8s_version() -> str:
    """The k8s.io/kubernetes version the wrapper module requires (its go.mod is the one place it is pinned)."""
    found = re.search(r"^\s*k8s\.io/kubernetes (v\S+)$", (MODULE / "go.mod").read_text(), re.M)
    assert found, f"{MODULE / 'go.mod'} does not require k8s.io/kubernetes"
    return found.group(1)


def ldflags() -> str:
    """-s -w: no symbol tables (smaller). The -X stamps are what Kubernetes' own build sets: without them the
    servers report v0.0.0-master, and a chart's `kubeVersion` constraint refuses the cluster."""
    version = k8s_version()
    major, minor = version.lstrip("v").split(".")[:2]
    stamps = [f"-X {pkg}.{var}={val}" for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
              for var, val in (("gitVersion", version), ("gitMajor", major), ("gitMinor", minor),
                               ("gitTreeState", "clean"))]
    return " ".join(["-s", "-w", *stamps])


def cache_key() -> str:
    digest = hashlib.sha256(b"".join((MODULE / f).read_bytes() for f in GO_FILES) + ldflags().encode()).hexdigest()
    return f"{k8s_version()}-{digest[:12]}"


def binary_path() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "inferscale" / "k8s" / cache_key() / NAME


def built() -> Path | None:
    path = binary_path()
    return path if os.access(path, os.X_OK) else None


def go_binary() -> str:
    found = shutil.which("go") or ("/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None)
    if not found:
        raise ControlPlaneUnavailable("no `go` on PATH (nor /usr/local/go/bin/go): the control plane is built from "
                                      "its Go modules (Go >= 1.26, about 5 GiB of disk for modules and build cache)")
    return found


def build(timeout: float = 5400) -> Path:
    """Build the binary when it is not cached yet (atomically: a half-written binary is never found)."""
    if path := built():
        return path
    path = binary_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{NAME}.{os.getpid()}.tmp")
    # No cgo: a static binary, and no C toolchain needed. -trimpath: reproducible.
    env = {**os.environ, "CGO_ENABLED": "0"}
    proc = subprocess.run([go_binary(), "build", "-trimpath", f"-ldflags={ldflags()}", "-o", str(tmp), "."], cwd=MODULE,
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ControlPlaneUnavailable(f"go build in {MODULE} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    tmp.rename(path)
    return path


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "path"
    if what == "path":
        path = built()
        print(path or f"not built: {binary_path()} (run: python e2e/controlplane_build.py build)")
        return 0 if path else 1
    if what == "build":
        started = time.monotonic()
        cached = built() is not None
        try:
            path = build()
        except ControlPlaneUnavailable as exc:
            print(f"controlplane_build: {exc}", file=sys.stderr)
            return 3
        how = "cached" if cached else f"built in {time.monotonic() - started:.0f}s"
        print(f"control plane {k8s_version()}: {path} ({how}, {path.stat().st_size >> 20} MiB)")
        return 0
    print("usage: controlplane_build.py [path|build]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
