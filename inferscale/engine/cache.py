"""Building request caches: the shared prefix KV plus k memory blocks rotated to where they now sit."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from inferscale.kernels.rope import rope_shift
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


def assemble_memory_kv(
    prefix_kv: torch.Tensor, blocks: list[KVBlock], layout: ModelLayout
) -> tuple[torch.Tensor, list[int]]:
    """[prefix][block 1]...[block k] as one tensor, each block's keys rotated from its encoded positions to its
    place. Returns the KV [layers, 2, H, N, D] and each block's start position."""
    p = prefix_kv.shape[3]
    lengths = [b.num_tokens for b in blocks]
    n = p + sum(lengths)
    out = torch.empty((*prefix_kv.shape[:3], n, prefix_kv.shape[4]), dtype=prefix_kv.dtype, device=prefix_kv.device)
    out[:, :, :, :p] = prefix_kv
    starts, deltas = [], []
    pos = p
    for block, length in zip(blocks, lengths):
        out[:, :, :, pos : pos + length] = block.kv.to(device=out.device, dtype=out.dtype)
        starts.append(pos)
        deltas.append(torch.full((length,), pos - block.start_pos, dtype=torch.long))
        pos += length
    if blocks:
        delta = torch.cat(deltas)
        # One rotation per group of layers sharing a θ (Gemma3: sliding 10k, full 1M), all blocks at once.
        for idx, inv_freq in layout.freq_groups().values():
            keys = out[idx, 0, :, p:]
            out[idx, 0, :, p:] = rope_shift(keys, delta, inv_freq)
    return out, starts
