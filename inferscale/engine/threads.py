"""How many CPU threads torch's kernels use: one rule for the server, the benchmarks and ``inferscale ask``.

No fixed count is right on a small CPU (issue 22, the 2-core AMX machine): a decode step is ~130 small matmuls and
one large one, and torch's OpenMP pool joins its threads at the end of every kernel. On a quiet machine two
threads read the weights faster (one decode step 88 ms vs 140 ms with one thread; ``Engine.ask`` 66 vs 115 ms a
token); when anything else is runnable (the HTTP event loop streaming tokens, another process) it preempts a pool
thread, every small kernel waits for it, and two threads lose badly (a step 1.06 s vs 0.25 s with one, the 126
layer projections 2.4 s vs 0.1 s, at load average 8).

The default is every usable core (``usable_cores``: the affinity mask, capped by a cgroup CPU quota), fixed: a
serving node is not shared with other work, and through the server on the quiet machine all cores won (a
single-stream step 98 ms vs 155 ms, 16 streams 48 vs 35 tokens/s, ``bench load``), while the tuner below, measuring
passes disturbed by the server's own event loop, settled on one thread. ``threads=-1``
(``INFERSCALE_TORCH_THREADS=-1``) starts on every core and lets the serving loop's ``ThreadTuner`` time its decode
passes and now and then run one with the other count (1 or all), keeping the faster at the same batch size: for a
node that shares its cores. An explicit count N is used as given, never tuned. One inter-op thread (the engine never
runs ops in parallel) and no Rust tokenizer pool (tokenization runs on its own thread already).

Only the engine thread computes on every core; any other thread that runs torch runs it on its own core
(``pin_threads(1)``: the server's event loop and its worker threads, the retrieval embedder among them), and heavy
work before serving runs on a thread that ends (``on_own_thread``: loading the model). Why: torch's OpenMP runtime
(libgomp) gives each thread that ever ran a parallel kernel a pool of worker threads kept for its lifetime, and once
it manages more threads than there are cores it stops letting idle workers spin: every worker then sleeps between
two kernels and is woken for the next, hundreds of times a decode step. On the 2-core machine two idle pools (the
model loaded on the main thread, one embedding on an executor thread) made the engine's decode step 19 -> 28 ms
and a server token 34 ms against 20 in process; pinned side threads keep it at 21.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from inferscale.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

_tuned: tuple[int, ...] = ()  # the counts the tuner may pick between; () when an explicit count was set


def usable_cores() -> int:
    """CPU cores this process may use: its affinity mask (which containers' cpusets narrow), and no more than its
    cgroups' CPU quota (``cpu_quota_cores``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cpu_quota_cores()
    return max(1, min(cores, quota)) if quota is not None else cores


def cpu_quota_cores(cgroup_root: Path = Path("/sys/fs/cgroup"),
                    membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """The CPU quota of this process's cgroup and its ancestors in whole cores, rounded up (cgroup v2 ``cpu.max``,
    v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``); None where none is set or none can be read.

    A Kubernetes pod with a CPU limit and the kubelet's default CPU manager keeps every core of the node in its
    affinity mask and gets the limit as a CFS quota: torch with a thread per node core would be throttled every
    period, each decode kernel waiting for its last thread. Read by hand: no maintained library reads cgroup quotas
    for Python (Go's automaxprocs and the JVM's container support do the same walk)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2: "0::/path"
            limits += _quotas(cgroup_root, path, _v2_quota)
        elif "cpu" in controllers.split(","):  # cgroup v1: "N:cpu,cpuacct:/path"
            mount = next((cgroup_root / name for name in (controllers, "cpu", "cpu,cpuacct")
                          if (cgroup_root / name / "cpu.cfs_quota_us").exists()), None)
            if mount is not None:
                limits += _quotas(mount, path, _v1_quota)
    return math.ceil(min(limits) - 1e-9) if limits else None


def _quotas(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas (in cores) set on ``path``'s cgroup and its ancestors under ``mount``; a container sees its own
    cgroup at the mount's root, so the path may not exist under it and the root's own is read then."""
    found = []
    parts = [p for p in path.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        quota = read(mount.joinpath(*parts[:depth]))
        if quota is not None:
            found.append(quota)
    return found


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def default_threads() -> int:
    return usable_cores()


def tuned_choices() -> tuple[int, ...]:
    """The thread counts a ``ThreadTuner`` picks between: (1, all cores) after an automatic configure, else ()."""
    return _tuned


def configure_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads: ``threads``, or 0/None for ``default_threads()``, or -1 for that many tuned as
    the loop runs; returns the number set."""
    import torch

    global _tuned
    if threads is not None and threads < -1:
        raise ConfigError(f"torch threads={threads}: expected -1 (tuned), 0 (every core) or more")
    tune = threads == -1
    n = default_threads() if tune or not threads else threads
    _tuned = (1, n) if tune and n > 1 else ()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # set before, or inter-op work already ran in this process: its pool is fixed
        pass
    return n


@functools.cache
def _thread_count_setters() -> tuple[Callable[[int], object], ...]:
    """The runtimes' own per-thread setters: OpenMP's ``omp_set_num_threads`` (the calling thread's count) and MKL's
    ``mkl_set_num_threads_local``, from the copies torch loaded (a library already loaded is found by its name).
    torch's ``set_num_threads`` also sets the default every thread starts from, which the engine thread reads."""
    import torch

    setters = []
    for lib, name in (("libgomp.so.1", "omp_set_num_threads"),
                      (os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"),
                       "MKL_Set_Num_Threads_Local")):
        try:
            setters.append(getattr(ctypes.CDLL(lib), name))
        except (OSError, AttributeError):  # another OpenMP runtime, or torch without MKL: one setter fewer
            log.debug("no %s in %s: threads not pinned through it", name, lib)
    return tuple(setters)


def pin_threads(n: int) -> None:
    """Run torch's kernels on ``n`` threads in the calling thread only (others keep theirs)."""
    import torch

    torch.get_num_threads()  # torch sets a thread's count on its first call there: before ours, not over it
    for set_count in _thread_count_setters():
        set_count(n)


def on_own_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on a thread that ends when it returns, taking its OpenMP pool with it; its result or its
    exception."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inferscale-load") as once:
        return once.submit(fn, *args).result()  # leaving the block joins the thread
