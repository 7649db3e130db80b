"""Encoding memory items into KV blocks, many items per forward pass.

Items are packed into one sequence after a copy of the shared prefix KV. A block-diagonal mask lets each item see
the prefix and itself only, and every item starts at the same position P = len(prefix), so a packed pass computes
exactly what encoding each item alone after the prefix would. Only the base model runs (no LM head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inferscale.engine.cache import cache_from_kv, kv_of_cache
from inferscale.engine.masks import attention_mask_arg
from inferscale.engine.template import MemoryItem
from inferscale.kvformat import KVBlock


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Greedy packing of item indices into groups of at most ``budget`` tokens (an item alone may exceed it)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and used + n > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


@torch.inference_mode()
def encode_items(
    engine,
    items: list[MemoryItem],
    *,
    batch_tokens: int = 1024,
    on_progress: Callable[[int], None] | None = None,
    embed: Callable[[list[str]], torch.Tensor] | None = None,
) -> list[KVBlock]:
    model, layout = engine.loaded.model, engine.loaded.layout
    p = len(engine.prefix_ids)
    token_lists = [engine.checked_item_ids(item) for item in items]  # all checked before any work
    embeddings = embed([item.text for item in items]) if embed is not None and items else None
    blocks: list[KVBlock | None] = [None] * len(items)
    for group in pack([len(t) for t in token_lists], batch_tokens):
        ids = torch.tensor([t for i in group for t in token_lists[i]], dtype=torch.long)
        seg = torch.cat([torch.full((len(token_lists[i]),), j) for j, i in enumerate(group)])
        q_pos = torch.cat([torch.arange(p, p + len(token_lists[i])) for i in group])
        # Keys: the prefix (segment -1, seen by all) then the packed items (seen within their own item, causally).
        k_pos = torch.cat([torch.arange(p), q_pos])
        k_seg = torch.cat([torch.full((p,), -1), seg])
        allowed = (k_seg[None, :] == -1) | ((k_seg[None, :] == seg[:, None]) & (k_pos[None, :] <= q_pos[:, None]))
        mask = attention_mask_arg(layout, allowed, q_pos, k_pos, engine.loaded.dtype, engine.device)
        cache = cache_from_kv(engine.prefix_kv, model.config, windowed=False)
        model.model(
            input_ids=ids[None].to(engine.device),
            position_ids=q_pos[None].to(engine.device),
            attention_mask=mask,
            cache=cache,
            use_cache=True,
        )
        kv = kv_of_cache(cache, start=p).cpu()
        offset = 0
        for i in group:
            n = len(token_lists[i])
            item = items[i]
            blocks[i] = KVBlock(
                item_id=item.id,
                text=item.text,
                timestamp=item.timestamp,
                token_ids=token_lists[i],
                start_pos=p,
                kv=kv[:, :, :, offset : offset + n].clone(),
                model_fingerprint=engine.loaded.fingerprint,
                prefix_sha256=engine.prefix_sha256,
                embedding=None if embeddings is None else embeddings[i].to(torch.float32).cpu(),
            )
            offset += n
        if on_progress is not None:
            on_progress(len(group))
    return [b for b in blocks if b is not None]

