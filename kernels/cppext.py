"""Our CPU kernels as torch C++ extensions: each built once per machine (gcc and ninja, on every machine of this
kind) into InferScale's cache, keyed by its source, flags and the torch version; later processes load the build.

A build already in the cache is loaded as it is, without ninja or a compiler and without writing anything: the
server image builds its kernels when it is made (the Dockerfile's model step) and its pods run with a read-only
root filesystem. Where the cache cannot be written (such a pod on a CPU the image was not built on), a kernel is
built under the temporary directory instead, and loaded from there the same way at the next start.

A kernel's module (``amx_linear.py``, ``rms_norm.py``) decides whether it can run here and checks its numbers;
this only builds and loads, and says False (the caller keeps aten's operations) where the build fails.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from inferscale.cachedir import cache_dir

log = logging.getLogger(__name__)
Op = TypeVar("Op")


def local_headers(source: Path) -> list[str]:
    """The headers of ours ``source`` includes (``#include "x.h"``, beside it): part of its build and its package."""
    return re.findall(r'^#include "([^"]+)"', source.read_text(), flags=re.MULTILINE)


def build_dir(source: Path, flags: list[str]) -> Path:
    """Keyed by the source, the headers of ours it includes and the flags."""
    digest = hashlib.sha256(b"".join([source.read_bytes(), *((source.parent / h).read_bytes()
                                                              for h in local_headers(source))])
                            + " ".join(flags).encode()).hexdigest()[:16]
    return cache_dir() / "torch-extensions" / f"{source.stem}-{torch.__version__}-{digest}"


def library(source: Path, target: Path) -> Path:
    """The shared library torch's build of ``source`` leaves in ``target``."""
    return target / f"inferscale_{source.stem}.so"


def writable(target: Path) -> Path:
    """``target`` (a ``build_dir``), or the same name under the temporary directory where the cache cannot be
    written."""
    try:
        target.mkdir(parents=True, exist_ok=True)
        if os.access(target, os.W_OK):
            return target
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / "inferscale-torch-extensions" / target.name
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def _load_built(source: Path, target: Path) -> bool:
    """Load the build of ``source`` in ``target`` if there is one; False where there is none or it does not load."""
    built = library(source, target)
    if not built.is_file():
        return False
    try:
        torch.ops.load_library(str(built))
    except (OSError, RuntimeError) as e:  # a build cut short: made again
        log.warning("%s's cached build did not load (%s); building it again", source.name, e)
        return False
    return True


def build(source: Path, flags: list[str]) -> bool:
    """Load the cached build of ``source`` (whose TORCH_LIBRARY registers its operators), else build it; False where
    it cannot be built here (no compiler, no ninja, a build error)."""
    from torch.utils import cpp_extension

    cached = build_dir(source, flags)
    if _load_built(source, cached):  # the cache's build: nothing written
        return True
    target = writable(cached)
    if target != cached and _load_built(source, target):  # a pod's own, under /tmp
        return True
    try:
        # -fopenmp at link time names libgomp.so.1, the soname torch's own runtime is already loaded under: one
        # OpenMP pool, so at::parallel_for shares torch's threads instead of starting its own.
        cpp_extension.load(name=f"inferscale_{source.stem}", sources=[str(source)], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], build_directory=str(target), is_python_module=False)
    except (RuntimeError, OSError, ImportError) as e:
        log.warning("%s not built (%s); aten's operations are used instead", source.name, str(e).splitlines()[0])
        return False
    return True


def built(source: Path, flags: list[str] | None, switch: str) -> bool:
    """Whether ``source`` is built and loaded for use here: not where the environment variable ``switch`` (the
    kernel's off switch) is "0", ``flags`` is None (this CPU lacks what the kernel needs) or the build fails."""
    return os.environ.get(switch, "1") != "0" and flags is not None and build(source, flags)


def checked(op: Op, agrees: Callable[[Op], bool], failure: str) -> Op | None:
    """``op`` where ``agrees(op)`` (its load-time check of numbers on this machine); else None, ``failure`` logged
    (what differed, what is used instead)."""
    with torch.inference_mode():
        if agrees(op):
            return op
    log.warning(failure)
    return None


def kept_packing(weight: torch.Tensor, attr: str, pack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``pack(weight)``, a kernel's own copy of a weight: made once and kept on the tensor object as ``attr``, made
    again once the tensor is written in place (its version moves). A tensor made in inference mode has no version
    to watch: packed on every call (tests' random weights, never the model's)."""
    if weight.is_inference():
        return pack(weight)
    held = getattr(weight, attr, None)
    if held is None or held[0] != weight._version:
        held = (weight._version, pack(weight))
        setattr(weight, attr, held)
    return held[1]
