"""Building request caches: the shared prefix KV plus k memory blocks rotated to where they now sit."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from inferscale import kvquant
from inferscale.contract import DEFAULT_KV_DTYPE
from inferscale.engine.slots import SlotCache
from inferscale.kernels import rotate_place
from inferscale.kernels.inject import rotate_in_place, shift_and_place  # Triton on CUDA, torch on CPU
from inferscale.kvformat import KVBlock
from inferscale.models.layout import ModelLayout


def kv_of_cache(cache: DynamicCache, start: int = 0) -> torch.Tensor:
    """The cache's K/V from token ``start`` on, stacked: [layers, 2, kv_heads, tokens, head_dim] (batch 0)."""
    return torch.stack([torch.stack((layer.keys[0, :, start:], layer.values[0, :, start:])) for layer in cache.layers])


def cache_from_kv(kv: torch.Tensor, config, *, windowed: bool = True) -> DynamicCache:
    """A model cache holding ``kv`` [layers, 2, H, N, D] as positions 0..N-1.

    With ``windowed`` the cache follows the model's layer types, so sliding-window layers keep only the last
    window-1 tokens: exactly what the model would attend to next. Without it every layer keeps all N (used by
    passes that bring their own masks)."""
    cache = DynamicCache(config=config) if windowed else DynamicCache()
    for i in range(kv.shape[0]):
        cache.update(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0), i)
    return cache


def injected_cache(
    prefix_kv: torch.Tensor, blocks: list[KVBlock], layout: ModelLayout, config, *, windowed: bool = True
) -> DynamicCache:
    """The cache of [prefix][block 1]...[block k], each block's keys rotated from the positions it was encoded at
    to the positions it now occupies (``injected_groups``, one layer group at a time)."""
    cache = DynamicCache(config=config) if windowed else DynamicCache()
    for idx, kv, _keep_from, n in injected_groups(prefix_kv, blocks, layout, windowed=windowed):
        for j, li in enumerate(idx):
            if windowed:
                _fill(cache.layers[li], kv[j, 0].unsqueeze(0), kv[j, 1].unsqueeze(0), n)
            else:
                cache.update(kv[j, 0].unsqueeze(0), kv[j, 1].unsqueeze(0), li)
    return cache


@dataclass
class GroupPlan:
    """One layer group's injection (one type: one θ, one window): what goes to positions keep_from..n-1."""

    idx: list[int]  # the group's layers
    inv_freq: torch.Tensor
    keep_from: int  # the first position the group's layers can still attend to
    n: int  # prefix + memory tokens
    sources: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # [layers, 2, H, tokens, D], first token
    deltas: list[int] = field(default_factory=list)  # per block source (after the prefix, which never moves)
    compact: list[tuple[KVBlock, int, int, int]] = field(default_factory=list)  # (block, skip, slot offset, Δ)

    @property
    def rotated_from(self) -> int:
        """Index of the first block source: the kept prefix, if any, comes first."""
        return len(self.sources) - len(self.deltas)


def group_plans(prefix_kv: torch.Tensor, blocks: list[KVBlock], layout: ModelLayout, *,
                windowed: bool = True) -> Iterator[GroupPlan]:
    """Per group of layers sharing a type, the tokens the model can still attend to, from which source: on a
    sliding layer that is the last window-1 tokens, so the work per request stays flat as k grows. ``windowed=False``
    keeps every token on every layer (for passes with their own masks). Compact blocks (``kv_dtype`` other than
    bf16) are listed in ``compact`` too, with Δ 0 in ``deltas``: they are rotated while dequantized."""
    p = prefix_kv.shape[3]
    starts, pos = [], p
    for b in blocks:
        starts.append(pos)
        pos += b.num_tokens
    n = pos
    for idx, inv_freq in layout.freq_groups().values():
        window = layout.layers[idx[0]].sliding_window if windowed else None
        keep_from = max(0, n - (window - 1)) if window else 0
        plan = GroupPlan(idx, inv_freq, keep_from, n)
        if keep_from < p:
            plan.sources.append((prefix_kv, keep_from))
        for b, start in zip(blocks, starts):
            if start + b.num_tokens <= keep_from:
                continue
            skip = max(0, keep_from - start)
            if b.kv_dtype != DEFAULT_KV_DTYPE:
                plan.compact.append((b, skip, start + skip - keep_from, start - b.start_pos))
                plan.deltas.append(0)  # rotated while dequantized (injected_groups); Δ 0 leaves its keys as they are
            else:
                plan.deltas.append(start - b.start_pos)
            plan.sources.append((b.kv, skip))
        yield plan


def injected_groups(
    prefix_kv: torch.Tensor, blocks: list[KVBlock], layout: ModelLayout, *, windowed: bool = True
) -> Iterator[tuple[list[int], torch.Tensor, int, int]]:
    """Per group of layers sharing a type: (layer indices, kv [G, 2, H, n - keep_from, D] of positions
    keep_from..n-1 with keys rotated into place, keep_from, n = prefix + memory tokens) (``group_plans``).

    Compact blocks are dequantized here and nowhere earlier: each goes through ``shift_and_place`` with its scale
    (dequantize, then rotate in float32), straight into its slot. Blocks of different formats can share a request:
    each is read in its own format."""
    dtype, device = prefix_kv.dtype, prefix_kv.device
    for plan in group_plans(prefix_kv, blocks, layout, windowed=windowed):
        idx, kept = plan.idx, plan.n - plan.keep_from
        kv = torch.empty((len(idx), *prefix_kv.shape[1:3], kept, prefix_kv.shape[4]), dtype=dtype, device=device)
        if not plan.compact:
            # Copy each run of consecutive layers with one cat straight into place: no per-block intermediates.
            for j0, j1 in _runs(idx):
                l0, l1 = idx[j0], idx[j1 - 1] + 1
                torch.cat([t[l0:l1, :, :, skip:].to(device=device, dtype=dtype) for t, skip in plan.sources], dim=3,
                          out=kv[j0:j1])
        else:
            _place_mixed(kv, idx, plan.sources, plan.compact, plan.inv_freq)
        if len(plan.deltas) > len(plan.compact):  # some float blocks still to rotate
            block_sources = plan.sources[plan.rotated_from:]
            delta = torch.cat([torch.full((t.shape[3] - skip,), d, dtype=torch.long)
                               for (t, skip), d in zip(block_sources, plan.deltas)])
            rotate_in_place(kv, kept - delta.numel(), delta, plan.inv_freq)  # the kept prefix tokens never move
        yield idx, kv, plan.keep_from, plan.n


def inject_into_slot(slots: SlotCache, slot: int, prefix_kv: torch.Tensor, blocks: list[KVBlock],
                     layout: ModelLayout) -> int:
    """The prefix and ``blocks`` into ``slot`` of ``slots``, each layer group windowed (``injected_groups``'
    contents); returns n. On CPU, bf16 blocks go through ``rotate_place`` (one pass, the same bits); other formats,
    other devices and CPUs without the kernel take ``injected_groups`` and ``SlotCache.write_groups``."""
    op = rotate_place.load() if prefix_kv.device.type == "cpu" else None
    if (op is None or slots.dtype != torch.bfloat16 or prefix_kv.dtype != torch.bfloat16
            or any(b.kv_dtype != DEFAULT_KV_DTYPE or b.kv.dtype != torch.bfloat16 or b.kv.device.type != "cpu"
                   for b in blocks)):
        return slots.write_groups(slot, injected_groups(prefix_kv, blocks, layout))
    n = prefix_kv.shape[3]
    for plan in group_plans(prefix_kv, blocks, layout):
        n = plan.n
        slots.reserve(slot + 1, n)
        if not plan.sources:
            continue
        cos, sin = rotate_place.rotations(plan.deltas, plan.inv_freq)
        op([slots.keys[i] for i in plan.idx], [slots.values[i] for i in plan.idx], slot, plan.keep_from,
           [t for t, _ in plan.sources], [skip for _, skip in plan.sources], plan.idx, cos, sin, plan.rotated_from)
    return n


def _place_mixed(kv: torch.Tensor, idx: list[int], sources: list[tuple[torch.Tensor, int]],
                 compact: list[tuple[KVBlock, int, int, int]], inv_freq: torch.Tensor) -> None:
    """Fill the group buffer ``kv`` [G, 2, H, kept, D] when some blocks are compact: float sources are copied
    into their slots; compact ones are dequantized, keys rotated by their Δ, and written by the kernel."""
    compact_kv = {id(b.kv) for b, *_ in compact}
    offset = 0
    for t, skip in sources:
        n = t.shape[3] - skip
        if id(t) not in compact_kv:
            for j0, j1 in _runs(idx):
                l0, l1 = idx[j0], idx[j1 - 1] + 1
                kv[j0:j1, :, :, offset : offset + n].copy_(t[l0:l1, :, :, skip:])
        offset += n
    # One kernel call per format (its blocks concatenated along tokens, each token with its own scale and Δ):
    # on CUDA that is one launch per layer group and format, whatever k is. Blocks reach the device compact.
    layers = torch.tensor(idx, dtype=torch.long, device=kv.device)
    by_format: dict[str, list[tuple[KVBlock, int, int, int]]] = {}
    for entry in compact:
        by_format.setdefault(entry[0].kv_dtype, []).append(entry)
    for fmt, entries in by_format.items():
        srcs, scales, positions, deltas = [], [], [], []
        for b, skip, at, delta in entries:
            src, scale = kvquant.injectable(b.kv.to(kv.device), b.kv_scale.to(kv.device), fmt)
            srcs.append(src.index_select(0, layers)[:, :, :, skip:])
            scales.append(scale.index_select(0, layers)[:, :, :, skip:])
            n = b.num_tokens - skip
            positions.append(torch.arange(at, at + n))
            deltas.append(torch.full((n,), delta, dtype=torch.long))
        src, scale = torch.cat(srcs, dim=3), torch.cat(scales, dim=3)
        g = range(len(idx))
        shift_and_place(src, kv, src_layers=g, dst_layers=g, src_tokens=range(src.shape[3]),
                        dst_positions=torch.cat(positions), deltas=torch.cat(deltas), inv_freq=inv_freq, scale=scale)


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """[0,1,2,4,5,7] → [(0,3), (3,5), (5,6)]: positions in ``idx`` where the layer numbers are consecutive."""
    runs, begin = [], 0
    for j in range(1, len(idx) + 1):
        if j == len(idx) or idx[j] != idx[j - 1] + 1:
            runs.append((begin, j))
            begin = j
    return runs


def _fill(layer, keys: torch.Tensor, values: torch.Tensor, total: int) -> None:
    """Load a cache layer without another copy. A sliding layer holds only its tail but must know the total
    length it has seen, which positions its masks from."""
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = total
