"""Preallocated per-slot KV for batched decode over ragged sequences (gpt-fast style, explicit positions).

Per layer one keys and one values tensor [slots, kv_heads, capacity, head_dim]. A sequence owns one slot row and
holds its tokens at indices 0..length-1, which are also their positions: the injected prefix and blocks (already
rotated into place), then the prompt, then generated tokens. A sliding-window layer sees only its window through
the attention mask, so injection writes (and rotates) on such a layer only the memory tokens the window can still
reach: the work of a kv request stays flat in k, and what the model computes is exactly the one-sequence path's.

A decode round runs rows 0..B-1 (the running sequences, kept contiguous) in one forward pass: each row writes its
new K/V at its own length and attends to indices <= length. Rows are views into the slot tensors; nothing is
gathered per round.
"""

from __future__ import annotations

import logging
import math
import mmap
import sys
import time
from collections.abc import Iterable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from inferscale.models.layout import ModelLayout

log = logging.getLogger(__name__)


class _SlotLayer(DynamicLayer):
    """One layer's view of the slot tensors for one forward pass: writes the new K/V where each row's tokens go."""

    def __init__(self, store: SlotCache, layer: int, rows: torch.Tensor, cells: torch.Tensor, kv_len: int,
                 span: tuple[int, int] | None) -> None:
        super().__init__()
        self.store, self.layer, self.rows, self.cells, self.kv_len = store, layer, rows, cells, kv_len
        self.span = span  # (first, last + 1) when the rows are contiguous: their K/V are a view, no copy
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [B, H, q, D]; row b's q new tokens go to indices starts[b] .. starts[b]+q-1: ``cells``, their
        # rows of the slot tensor seen as [slots * H * capacity, D] (one index_copy_ instead of an index_put_ over
        # two index tensors, which took ~10 % of a 16-row decode step)
        keys, values = self.store.keys[self.layer], self.store.values[self.layer]
        dim = keys.shape[-1]
        keys.view(-1, dim).index_copy_(0, self.cells, key_states.reshape(-1, dim).to(keys.dtype))
        values.view(-1, dim).index_copy_(0, self.cells, value_states.reshape(-1, dim).to(values.dtype))
        if self.span is not None:
            r0, r1 = self.span
            return keys[r0:r1, :, : self.kv_len], values[r0:r1, :, : self.kv_len]
        return keys[self.rows, :, : self.kv_len], values[self.rows, :, : self.kv_len]

    def get_seq_length(self) -> int:
        return self.kv_len


# Tokens a slot holds from the start: a k=20 kv prompt and its answer (4 slots: 75 MB of bf16 K/V for Gemma-3-270M).
# Growing (a copy of every layer's K/V, first touch of new pages) cost the first request after a start ~160 ms, twice:
# its prompt, then its first decode step (issue 22). A server starts bigger (``inferscale serve``: INFERSCALE_KV_SLOTS
# x INFERSCALE_KV_SLOT_TOKENS, reserved before it listens, as vLLM sizes its KV cache at start): every growth stalls
# the step it falls in for every tenant (a first flood of long prompts grew 4 -> 8 slots of 2,048 tokens in 247 and
# 265 ms on the 2-core VM; a 2,936-token prompt past 16 x 2,048 grew it to 16 x 4,096 in 302-316 ms, a 391 ms gap in
# another tenant's stream). On a CPU the pool is therefore mapped whole instead (``lazy_zeros``): every slot the loop
# can run at the model's whole context, the kernel backing a page when it is first written, so nothing is ever
# reallocated or copied and a request past the reservation pays only the first touch of its own new pages.
FIRST_SLOTS = 4
FIRST_CAPACITY = 1024
GROWTH_QUANTUM = 256  # tokens: a grown capacity is a multiple of it
# Linux's flag for a mapping not counted against overcommit (Python's mmap module names it only from 3.13): the pool
# addresses far more than it will hold, and only what it holds is memory.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap] | None:
    """A CPU tensor of zeros over an anonymous private mapping, and the mapping: the kernel backs (and zeroes) each
    page when it is first touched, so a tensor of gigabytes costs nothing until written, and gives a page back
    when told (``drop_pages``). None where no such mapping is had (not Linux, or strict overcommit refusing it): the
    caller allocates as usual."""
    if not MAP_NORESERVE:
        return None
    try:
        region = mmap.mmap(-1, math.prod(shape) * dtype.itemsize,
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except (OSError, ValueError):
        return None
    return torch.frombuffer(region, dtype=dtype).view(shape), region  # the tensor keeps the mapping alive


def drop_pages(region: mmap.mmap, start: int, end: int) -> None:
    """Give back the whole pages of bytes [start, end) of ``region``: they read zero until written again. The pages
    only partly inside are kept (they hold bytes outside the range)."""
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if first < last:
        region.madvise(mmap.MADV_DONTNEED, first, last - first)


class SlotCache:
    """KV storage for ``slots`` sequences of ``capacity`` tokens, backed before the first request. With ``most``
    (slots, tokens) on a CPU, the tensors address that much from the start (``lazy_zeros``) and never grow; else (a
    GPU, or no such mapping here) they grow on demand by reallocation."""

    def __init__(self, layout: ModelLayout, dtype: torch.dtype, device: torch.device, *, slots: int = FIRST_SLOTS,
                 capacity: int = FIRST_CAPACITY, most: tuple[int, int] | None = None) -> None:
        self.layout, self.dtype, self.device = layout, dtype, device
        self.num_layers = len(layout.layers)
        self.reserved = (slots, capacity)
        # Seconds spent growing (``reserve``), which the serving loop leaves out of the passes and steps it times: a
        # growth reallocates every layer's K and V once (152-246 ms to 4-8 slots of 2,048 tokens on the 2-core VM,
        # fresh memory being slow to touch there), and learnt as the cost of the prompt pass it fell in (a 64-token
        # pass of 253 ms against ~60) it doubled the per-token estimate and shed two kept requests 1.6 s in.
        self.grown_s = 0.0
        # Seconds spent moving rows (``swap``: a sequence starting to decode or ending), a request's cost once, not a
        # pass's: learnt as one (a 38-row decode pass in which 10 ended, each end moving the last rows into its slot,
        # read 246 ms against ~55) it priced a full batch 40 % dearer for the next requests' admission.
        self.moved_s = 0.0
        mapped = self._mapped(max(most[0], slots), max(most[1], capacity)) if most is not None else None
        self._regions: list[mmap.mmap] = []  # a mapped pool's, by tensor: keys' then values'
        if mapped is not None:
            tensors, regions = zip(*mapped)
            self.keys, self.values = list(tensors[: self.num_layers]), list(tensors[self.num_layers:])
            self._regions = list(regions)
            for t in (*self.keys, *self.values):  # the reservation's pages backed now, before any request
                t[:slots, :, :capacity].zero_()
        else:
            shape = (slots, layout.num_kv_heads, capacity, layout.head_dim)
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        # a mapped pool's: each slot's end of the tokens written since its pages last went back (``trim``)
        self.depth = [0] * self.slots

    def _mapped(self, slots: int, capacity: int) -> list[tuple[torch.Tensor, mmap.mmap]] | None:
        """Every layer's K, then every layer's V, at ``slots`` x ``capacity`` over lazily backed mappings; None on a
        GPU or where one is refused."""
        if torch.device(self.device).type != "cpu":
            return None
        shape = (slots, self.layout.num_kv_heads, capacity, self.layout.head_dim)
        mapped = [lazy_zeros(shape, self.dtype) for _ in range(2 * self.num_layers)]
        return None if any(m is None for m in mapped) else mapped  # type: ignore[return-value]

    @property
    def lazy(self) -> bool:
        """The pool is mapped whole (``lazy_zeros``): it never grows and gives pages back (``trim``)."""
        return bool(self._regions)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, slots: int, capacity: int) -> None:
        """Make room for ``slots`` rows of ``capacity`` tokens (at least doubling, so growth is amortized)."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        if self.lazy:  # the loop runs no more rows than it mapped, nor a sequence past the model's context
            raise ValueError(f"slot pool: {slots} slots x {capacity} tokens asked of a pool mapped at {self.slots} x "
                             f"{self.capacity}")
        new_s = max(self.slots, slots if slots <= self.slots else max(slots, 2 * self.slots))
        # whole quanta: a prompt that fills the new capacity would grow it again one decode step later
        wanted = -(-capacity // GROWTH_QUANTUM) * GROWTH_QUANTUM
        new_c = max(self.capacity, capacity if capacity <= self.capacity else max(wanted, 2 * self.capacity))
        t0 = time.perf_counter()
        self._grow(new_s, new_c)
        took = time.perf_counter() - t0
        self.grown_s += took
        # an operator's cue: every stream waited this out (a server reserves more with INFERSCALE_KV_SLOTS and
        # INFERSCALE_KV_SLOT_TOKENS)
        log.info("slot pool grew to %d slots x %d tokens (%.0f MB) in %.0f ms", new_s, new_c, self.nbytes / 1e6,
                 took * 1e3)

    @property
    def nbytes(self) -> int:
        """Bytes the pool addresses, every layer's K and V (a lazy pool holds only the pages written)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def _grow(self, slots: int, capacity: int) -> None:
        """Reallocate every layer's K and V at ``slots`` x ``capacity``, keeping what they hold."""
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                new = torch.zeros((slots, old.shape[1], capacity, old.shape[3]), dtype=self.dtype, device=self.device)
                new[: old.shape[0], :, : old.shape[2]] = old
                tensors[i] = new

    def write(self, slot: int, kv: torch.Tensor) -> None:
        """Put ``kv`` [layers, 2, H, N, D] at indices 0..N-1 of ``slot``."""
        n = kv.shape[3]
        self.reserve(slot + 1, n)
        self._wrote(slot, n)
        for i in range(self.num_layers):
            self.keys[i][slot, :, :n] = kv[i, 0].to(self.dtype)
            self.values[i][slot, :, :n] = kv[i, 1].to(self.dtype)

    def write_groups(self, slot: int, groups: Iterable[tuple[list[int], torch.Tensor, int, int]]) -> int:
        """Put each layer group's kv [G, 2, H, n - start, D] at indices start..n-1 of ``slot`` (``injected_groups``:
        a sliding layer gets only the tokens its window can still reach; the mask hides the indices before them,
        whatever they hold). Returns n."""
        n = 0
        for idx, kv, start, n in groups:
            self.reserve(slot + 1, n)
            self._wrote(slot, n)
            for j, li in enumerate(idx):
                self.keys[li][slot, :, start:n] = kv[j, 0].to(self.dtype)
                self.values[li][slot, :, start:n] = kv[j, 1].to(self.dtype)
        return n

    def swap(self, a: int, b: int, len_a: int, len_b: int) -> None:
        """Exchange slots ``a`` and ``b`` (their first len_a / len_b tokens): keeps decoding rows contiguous. A
        ``len_a`` of 0 moves ``b``'s into ``a`` alone (``a``'s sequence ended: nothing of it is read again)."""
        t0 = time.perf_counter()
        for tensors in (self.keys, self.values):
            for t in tensors:
                self._exchange(t, a, b, len_a, len_b)
        self._wrote(a, len_b)
        self._wrote(b, len_a)
        self.moved_s += time.perf_counter() - t0

    @staticmethod
    def _exchange(t: torch.Tensor, a: int, b: int, len_a: int, len_b: int) -> None:
        held = t[a, :, :len_a].clone() if len_a else None
        t[a, :, :len_b] = t[b, :, :len_b]
        if held is not None:
            t[b, :, :len_a] = held

    @property
    def aside_s(self) -> float:
        """Seconds spent growing and moving rows: none of it a pass's cost (the serving loop leaves it out of them)."""
        return self.grown_s + self.moved_s

    def _wrote(self, slot: int, end: int) -> None:
        if self._regions and end > self.depth[slot]:
            self.depth[slot] = end

    def _reserved_tokens(self, slot: int) -> int:
        return self.reserved[1] if slot < self.reserved[0] else 0

    @property
    def backed(self) -> int:
        """Tokens a mapped pool's slots have written past the reservation and still hold (0 for an allocated pool)."""
        return sum(max(d - self._reserved_tokens(s), 0) for s, d in enumerate(self.depth)) if self._regions else 0

    def trim(self, lengths: list[int], room: int) -> None:
        """Where a mapped pool's slots hold more than ``room`` tokens past the reservation and past the
        ``lengths[slot]`` tokens of the sequences they hold (none past the list), give those pages back. With ``room``
        what the K/V budget leaves beside what the running requests may hold, the pool's pages past the reservation
        stay within the budget (and a pass's padding), not at the deepest tokens each slot ever held. Within it a
        finished sequence's pages stay for the next one: written again after they went back they cost ~11x (12.5 ms
        against 1.2 for a k=20 request's 800 tokens of Gemma-3-270M, 2-core VM)."""
        if not self._regions:
            return
        keep = [max(lengths[s] if s < len(lengths) else 0, self._reserved_tokens(s)) for s in range(len(self.depth))]
        if sum(max(d - k, 0) for d, k in zip(self.depth, keep)) <= room:
            return
        heads, row = self.layout.num_kv_heads, self.layout.head_dim * self.dtype.itemsize
        for slot, (depth, start) in enumerate(zip(self.depth, keep)):
            if depth <= start:
                continue
            for region in self._regions:
                for h in range(heads):
                    base = (slot * heads + h) * self.capacity
                    drop_pages(region, (base + start) * row, (base + self.capacity) * row)
            self.depth[slot] = start

    def view(self, rows: list[int], starts: list[int], q: int) -> DynamicCache:
        """A model cache for one forward pass: row b writes q new tokens at starts[b].. and reads indices
        0..max(starts)+q-1 (the mask hides what a row must not see)."""
        kv_len = max(starts) + q
        self.reserve(max(rows) + 1, kv_len)
        for r, start in zip(rows, starts):
            self._wrote(r, start + q)
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        heads, capacity = self.keys[0].shape[1], self.capacity
        # the cell of row b, head h, new token t: ((rows[b] * H + h) * capacity + starts[b] + t), in [B, H, q] order
        cells = ((rows_t[:, None, None] * heads + torch.arange(heads, device=self.device)[None, :, None]) * capacity
                 + torch.tensor(starts, dtype=torch.long, device=self.device)[:, None, None]
                 + torch.arange(q, device=self.device)[None, None, :]).reshape(-1)
        span = (rows[0], rows[-1] + 1) if rows[-1] + 1 - rows[0] == len(rows) else None
        cache = DynamicCache()
        cache.layers = [_SlotLayer(self, i, rows_t, cells, kv_len, span) for i in range(self.num_layers)]
        return cache

    def mask(self, starts: list[int], q: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """``attention_mask=`` for rows whose q new tokens sit at positions starts[b]..: causal over the row's own
        tokens (indices = positions), each sliding layer type further limited to its window. [B, 1, q, kv_len]."""
        kv_len = max(starts) + q
        q_pos = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(q)[None]  # [B, q]
        k_pos = torch.arange(kv_len)
        diff = q_pos[:, :, None] - k_pos[None, None, :]  # [B, q, K]
        masks: dict[str, torch.Tensor] = {}
        for spec in self.layout.layers:
            if spec.layer_type in masks:
                continue
            allowed = diff >= 0
            if spec.sliding_window is not None:
                allowed &= diff < spec.sliding_window
            m = torch.zeros(allowed.shape, dtype=self.dtype)
            m.masked_fill_(~allowed, torch.finfo(self.dtype).min)
            masks[spec.layer_type] = m[:, None].to(self.device)
        return masks if self.layout.mixed else next(iter(masks.values()))
