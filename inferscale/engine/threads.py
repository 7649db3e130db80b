"""How many CPU threads torch's kernels use: one rule for the server, the benchmarks and ``inferscale ask``.

No fixed count is right on a small CPU (issue 22, the 2-core AMX machine): a decode step is ~130 small matmuls and
one large one, and torch's OpenMP pool joins its threads at the end of every kernel. On a quiet machine two
threads read the weights faster (one decode step 88 ms vs 140 ms with one thread; ``Engine.ask`` 66 vs 115 ms a
token); when anything else is runnable (the HTTP event loop streaming tokens, another process) it preempts a pool
thread, every small kernel waits for it, and two threads lose badly (a step 1.06 s vs 0.25 s with one, the 126
layer projections 2.4 s vs 0.1 s, at load average 8).

The default is every usable core, fixed: a serving node is not shared with other work, and through the server on
the quiet machine all cores won (a single-stream step 98 ms vs 155 ms, 16 streams 48 vs 35 tokens/s, ``bench
load``), while the tuner below, measuring passes disturbed by the server's own event loop, settled on one thread.
``threads=-1`` (``INFERSCALE_TORCH_THREADS=-1``) starts on every core and lets the serving loop's ``ThreadTuner``
time its decode passes and now and then run one with the other count (1 or all), keeping the faster at the same
batch size: for a node that shares its cores. An explicit count N is used as given, never tuned. One inter-op thread (the engine never runs ops in parallel) and no Rust tokenizer
pool (tokenization runs on its own thread already).

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
import os
from collections.abc import Callable
from typing import TypeVar

from inferscale.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

_tuned: tuple[int, ...] = ()  # the counts the tuner may pick between; () when an explicit count was set


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers' cpusets narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
