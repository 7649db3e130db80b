"""One large DRAM buffer per store, registered with NIXL once and sub-allocated per block.

Registering memory with a transport is expensive (pinning, rkeys), so the DRAM tier is a single arena of
``budget`` bytes; blocks are byte ranges in it. A first-fit free list with coalescing is enough: blocks are
similar in size and a user's blocks are allocated together, so they sit contiguously and travel as one range."""

from __future__ import annotations

import bisect
import mmap

import numpy as np
import torch

ALIGN = 64  # cache-line aligned slots; also keeps every tensor inside a blob aligned for zero-copy views
HUGE_PAGE = 2 << 20


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class Allocator:
    """First-fit allocator over [0, size). Not thread-safe: the DRAM tier's lock guards it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]  # sorted starts of free extents
        self._lens: dict[int, int] = {0: size}
        self.used = 0

    @property
    def free_bytes(self) -> int:
        return self.size - self.used

    def largest_free(self) -> int:
        return max(self._lens.values(), default=0)

    def alloc(self, n: int) -> int | None:
        n = align_up(n)
        for start in self._starts:
            length = self._lens[start]
            if length >= n:
                self._starts.remove(start)
                del self._lens[start]
                if length > n:
                    bisect.insort(self._starts, start + n)
                    self._lens[start + n] = length - n
                self.used += n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        n = align_up(n)
        self.used -= n
        i = bisect.bisect_left(self._starts, start)
        # merge with the following extent
        if i < len(self._starts) and self._starts[i] == start + n:
            nxt = self._starts.pop(i)
            n += self._lens.pop(nxt)
        # merge with the preceding extent
        if i > 0 and self._starts[i - 1] + self._lens[self._starts[i - 1]] == start:
            prev = self._starts[i - 1]
            self._lens[prev] += n
            return
        self._starts.insert(i, start)
        self._lens[start] = n


def huge_page_buffer(size: int) -> torch.Tensor:
    """``size`` bytes of anonymous memory, 2 MiB aligned and advised as transparent huge pages: the kernel copies
    peer WRITEs (UCX CMA, process_vm_writev) and socket reads into it page by page, and on 4 KiB pages pinning
    each one costs about a quarter of the copy (a 24.7 MB peer write: 8.8 ms on 4 KiB pages, 6.5 ms on huge)."""
    m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(m, dtype=np.uint8)
    skip = -view.ctypes.data % HUGE_PAGE
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):  # advice only: without it, 4 KiB pages
        m.madvise(mmap.MADV_HUGEPAGE)
    return torch.from_numpy(view[skip : skip + size])  # the tensor keeps the mapping alive


class Arena:
    """The DRAM tier's bytes: a uint8 tensor (page-locked when CUDA is present, so GPU copies are DMA; else
    huge-page backed)."""

    def __init__(self, size: int, *, pin: bool = False) -> None:
        self.size = size
        self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True) if pin else huge_page_buffer(size)
        self.np = self.tensor.numpy()
        self.base = self.tensor.data_ptr()
        self.allocator = Allocator(size)

    def view(self, offset: int, n: int) -> memoryview:
        return memoryview(self.np[offset : offset + n])
