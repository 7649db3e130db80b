"""The CPU's feature flags as the kernel reports them (``/proc/cpuinfo``): what bf16 and AMX paths may run here."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first processor's flags (``avx512_bf16``, ``amx_bf16``, ...); empty where the file is not there."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
