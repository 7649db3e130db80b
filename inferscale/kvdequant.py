"""Float K/V of a stored block (for consumers that need plain tensors, and tests): the injection kernel
(``kernels.inject``) with every Δ = 0, so there is one dequantizer. Kept out of ``inferscale.kvquant`` so that the
formats themselves import no kernel."""

from __future__ import annotations

import torch

from inferscale.kernels.inject import inject_reference, shift_and_place
from inferscale.kvquant import injectable


def dequantize(kv: torch.Tensor, scale: torch.Tensor | None, kv_dtype: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float KV of a stored block (for consumers that need plain tensors, and tests): the injection kernel with
    every Δ = 0, so there is one dequantizer."""
    if kv_dtype == "bf16":
        return kv.to(dtype)
    src, sc = injectable(kv, scale, kv_dtype)
    layers, tokens = range(src.shape[0]), range(src.shape[3])
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    zero_freq = torch.zeros(src.shape[4] // 2, dtype=torch.float32)
    place = shift_and_place if src.is_cuda else inject_reference
    return place(src, out, src_layers=layers, dst_layers=layers, src_tokens=tokens, dst_positions=tokens,
                 deltas=torch.zeros(len(tokens), dtype=torch.long), inv_freq=zero_freq, scale=sc)
