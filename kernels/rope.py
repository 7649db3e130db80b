"""RoPE shift: move cached keys from the positions they were encoded at to new positions.

RoPE rotates each (i, i + d/2) pair of a key at position p by p·θ_i. Rotations compose, so a key encoded at p
moves to p + Δ by one more rotation of Δ·θ_i:  k' = k·cos(Δθ) + rotate_half(k)·sin(Δθ).
Computed in float32 and cast back, so bf16/fp16 blocks lose nothing to the trigonometry. Values are untouched.
This is the torch reference; a Triton version must match it.
"""

from __future__ import annotations

import torch


def shift_cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of Δ·θ for each token: delta [T] (int) , inv_freq [D/2] → two [T, D] float32 tensors."""
    # A block shares one Δ, so trigonometry runs once per distinct Δ, in float64 (exact for Δ up to ~1e5).
    uniq, inverse = torch.unique(delta, return_inverse=True)
    angles = uniq.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(torch.float32)[inverse], angles.sin().to(torch.float32)[inverse]


def rope_shift(
    keys: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor, *, inplace: bool = False
) -> torch.Tensor:
    """Rotate ``keys`` [..., T, D] by ``delta`` (an int, or [T] per token) with frequencies ``inv_freq`` [D/2].

    ``inplace`` writes the result back into ``keys`` (e.g. a slice of a cache being assembled)."""
    n, half = keys.shape[-2], keys.shape[-1] // 2
    if not isinstance(delta, torch.Tensor):
        delta = torch.full((n,), int(delta), dtype=torch.long)
    cos, sin = shift_cos_sin(delta.cpu(), inv_freq.cpu())
    cos, sin = cos.to(keys.device), sin.to(keys.device)
    k32 = keys.to(torch.float32)
    # k·cos + rotate_half(k)·sin, where rotate_half(k) = (-k[h:], k[:h]); written as two fused multiply-adds.
    out = k32 * cos
    out[..., :half].addcmul_(k32[..., half:], sin[..., :half], value=-1.0)
    out[..., half:].addcmul_(k32[..., :half], sin[..., half:])
    if inplace:
        return keys.copy_(out)
    return out.to(keys.dtype)
