"""Argument checks shared by both inject implementations (``inject.inject_reference`` and the Triton kernel in
``inject_triton``): their own module, so the Triton one imports them without importing ``inject`` back."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inferscale.errors import ConfigError


def as_index(x: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.long).to(device)


def check_inject_args(src: torch.Tensor, dst: torch.Tensor, *, src_layers, dst_layers, src_tokens, dst_positions,
                      deltas, inv_freq: torch.Tensor, scale: torch.Tensor | None, page_table,
                      tokens_per_page: int | None) -> None:
    """Shape and range checks shared by both implementations: a bad plan is a ConfigError, never a silent write
    outside the request's pages."""
    if src.dim() != 5 or src.shape[1] != 2:
        raise ConfigError(f"inject: src must be [layers, 2, heads, tokens, head_dim], got {tuple(src.shape)}")
    paged = page_table is not None
    want = 6 if paged else 5
    if dst.dim() != want:
        raise ConfigError(f"inject: dst must have {want} dims ({'paged pool' if paged else 'cache'}), got {tuple(dst.shape)}")
    h, d = src.shape[2], src.shape[4]
    dh, dd = (dst.shape[3], dst.shape[5]) if paged else (dst.shape[2], dst.shape[4])
    if (h, d) != (dh, dd):
        raise ConfigError(f"inject: src heads/head_dim {(h, d)} != dst {(dh, dd)}")
    if d % 2:
        raise ConfigError(f"inject: head_dim {d} is odd; RoPE rotates pairs")
    if inv_freq.numel() != d // 2:
        raise ConfigError(f"inject: inv_freq has {inv_freq.numel()} entries, head_dim {d} needs {d // 2}")
    if len(src_layers) != len(dst_layers):
        raise ConfigError("inject: src_layers and dst_layers differ in length")
    if not len(src_tokens) == len(dst_positions) == len(deltas):
        raise ConfigError("inject: src_tokens, dst_positions and deltas differ in length")
    if src.dtype in (torch.int8, torch.uint8) and scale is None:
        raise ConfigError("inject: integer src needs a scale")
    if scale is not None:
        try:
            torch.broadcast_shapes(scale.shape, src.shape)
        except RuntimeError as e:
            raise ConfigError(f"inject: scale {tuple(scale.shape)} does not broadcast to src {tuple(src.shape)}") from e
    if paged and (tokens_per_page is None or tokens_per_page != dst.shape[4]):
        raise ConfigError(f"inject: tokens_per_page {tokens_per_page} != pool page size {dst.shape[4]}")
    layer_cap = dst.shape[1] if paged else dst.shape[0]
    _in_range("src_layers", src_layers, src.shape[0])
    _in_range("dst_layers", dst_layers, layer_cap)
    _in_range("src_tokens", src_tokens, src.shape[3])
    if paged:
        _in_range("dst_positions", dst_positions, len(page_table) * tokens_per_page)
        _in_range("page_table", page_table, dst.shape[0])
    else:
        _in_range("dst_positions", dst_positions, dst.shape[3])


def _in_range(name: str, values, bound: int) -> None:
    t = torch.as_tensor(values)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= bound):
        raise ConfigError(f"inject: {name} outside [0, {bound})")
