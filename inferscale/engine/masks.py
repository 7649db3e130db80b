"""Custom attention masks for packed encoding and selective recompute.

Both passes feed tokens whose attention pattern is not plain causal over the cache. We describe the pattern once
as a boolean [queries, keys] matrix plus each side's positions, and derive each layer type's mask from it (sliding
layers additionally see only keys within their window). Masks are additive floats so eager and sdpa both take them.
"""

from __future__ import annotations

import torch

from inferscale.models.layout import ModelLayout


def attention_mask_arg(
    layout: ModelLayout,
    allowed: torch.Tensor,  # [Q, K] bool
    q_pos: torch.Tensor,  # [Q] long
    k_pos: torch.Tensor,  # [K] long
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor | dict[str, torch.Tensor]:
    """What to pass as ``attention_mask=``: one 4D mask, or a dict per layer type for mixed models."""
    masks: dict[str, torch.Tensor] = {}
    for spec in layout.layers:
        if spec.layer_type in masks:
            continue
        a = allowed
        if spec.sliding_window is not None:
            a = a & ((q_pos[:, None] - k_pos[None, :]) < spec.sliding_window)
        m = torch.zeros(a.shape, dtype=dtype)
        m.masked_fill_(~a, torch.finfo(dtype).min)
        masks[spec.layer_type] = m[None, None].to(device)
    return masks if layout.mixed else next(iter(masks.values()))
