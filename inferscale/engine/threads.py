"""How many CPU threads torch's kernels use: one rule for the server, the benchmarks and ``inferscale ask``.

A decode step is ~130 small matmuls (18 layers x 7 projections) and one large one (the LM head). torch's OpenMP
pool joins its threads at the end of every kernel; when the pool holds every core, any other runnable thread (the
HTTP event loop streaming tokens, the tokenizer, another process) preempts a pool thread and every small kernel
waits for it. Measured on the 2-core machine (issue 22): a 640x2048 bf16 matmul took 6-16 ms with 2 threads under
load and 0.4 ms with 1, and a whole decode step 1.1-1.4 s vs 0.17 s. So by default the engine leaves one core to
the rest of the process: ``cores - 1`` threads (at least 1). One inter-op thread (the engine never runs ops in
parallel) and no Rust tokenizer pool (tokenization runs on its own thread already).
"""

from __future__ import annotations

import os

from inferscale.errors import ConfigError

def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers' cpusets narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads() -> int:
    return max(1, usable_cores() - 1)


def configure_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads (``threads``, or 0/None for ``default_threads()``); returns the number set."""
    import torch

    if threads is not None and threads < 0:
        raise ConfigError(f"torch threads={threads}: expected 0 (automatic) or more")
    n = threads or default_threads()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # set before, or inter-op work already ran in this process: its pool is fixed
        pass
    return n
