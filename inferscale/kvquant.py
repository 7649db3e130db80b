"""Compact KV formats: how a block's K/V are stored and moved, and how they become what injection reads.

A format is chosen per deployment (``--kv-dtype``, ``INFERSCALE_KV_DTYPE``; names in ``inferscale.contract``):
  bf16  uncompressed: the model's own dtype (bf16 on GPUs), no scale.
  int8  symmetric per token: one float32 scale per (layer, k/v, head, token) = absmax over head_dim / 127;
        ``kv`` int8 [L, 2, H, N, D], ``kv_scale`` [L, 2, H, N, 1].
  fp8   float8 e4m3 per token: scale = absmax / 448 (e4m3's largest finite), same shapes as int8.
  int4  symmetric groups of ``int4_group(D)`` channels (32 when D allows): scale = group absmax / 7; two values a
        byte (low nibble = even channel, stored as q + 8); ``kv`` uint8 [L, 2, H, N, D/2], ``kv_scale``
        [L, 2, H, N, D/group].
Per token rather than per channel because blocks are concatenated along tokens at injection: a per-token scale
travels with its token, so one ``scale`` tensor covers a request's blocks (``kernels.inject`` takes it as is).

Keys are quantized as encoded, before any RoPE shift; injection dequantizes and only then rotates, in float32
(``kernels.inject.shift_and_place(..., scale=)``: the one dequantizer). ``injectable`` turns a stored block into
that kernel's (src, scale): int8 and fp8 go as stored; int4 is unpacked to int8 codes with its group scales
broadcast to channels.
"""

from __future__ import annotations

import torch

from inferscale.contract import KV_DTYPES
from inferscale.errors import BlobCorruptError, ConfigError

SCALE_DTYPE = torch.float32
INT8_MAX = 127.0
INT4_MAX = 7.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The stored tensor's dtype per format (bf16 stores whatever float dtype the model runs in).
STORED_DTYPE: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": FP8_DTYPE, "int4": torch.uint8}


def check_kv_dtype(name: str) -> str:
    """``name`` when it is a known format, else ConfigError naming the choices."""
    if name not in KV_DTYPES:
        raise ConfigError(f"kv dtype {name!r}: expected one of {', '.join(KV_DTYPES)}")
    return name


def parse_kv_dtypes(text: str) -> list[str]:
    """A comma list of formats (``bf16,int8``), each checked."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError("kv dtype list is empty")
    return [check_kv_dtype(n) for n in names]


def int4_group(head_dim: int) -> int:
    """Channels sharing one int4 scale: the largest of 32, 16, 8, 4, 2 dividing head_dim (RoPE makes it even)."""
    for g in (32, 16, 8, 4, 2):
        if head_dim % g == 0:
            return g
    raise ConfigError(f"int4: head_dim {head_dim} is odd")


def _safe(absmax: torch.Tensor, top: float) -> torch.Tensor:
    # An all-zero row gets scale 1 (its codes are 0 either way) so nothing divides by zero.
    return torch.where(absmax > 0, absmax / top, torch.ones_like(absmax)).to(SCALE_DTYPE)


def quantize(kv: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stored kv, scale) of a float ``kv`` [L, 2, H, N, D] in ``kv_dtype``; bf16 returns ``kv`` and None."""
    check_kv_dtype(kv_dtype)
    if kv_dtype == "bf16":
        return kv, None
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ConfigError(f"quantize: kv must be [layers, 2, heads, tokens, head_dim], got {tuple(kv.shape)}")
    x = kv.detach().to(torch.float32)
    if kv_dtype == "int8":
        scale = _safe(x.abs().amax(dim=-1, keepdim=True), INT8_MAX)
        return torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    if kv_dtype == "fp8":
        scale = _safe(x.abs().amax(dim=-1, keepdim=True), FP8_MAX)
        return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    g = int4_group(x.shape[-1])
    groups = x.unflatten(-1, (x.shape[-1] // g, g))  # [L, 2, H, N, D/g, g]
    scale = _safe(groups.abs().amax(dim=-1), INT4_MAX)  # [L, 2, H, N, D/g]
    codes = torch.round(groups / scale.unsqueeze(-1)).clamp_(-INT4_MAX, INT4_MAX).flatten(-2)
    u = (codes + 8).to(torch.uint8)  # 1..15
    return u[..., 0::2] | (u[..., 1::2] << 4), scale


def injectable(kv: torch.Tensor, scale: torch.Tensor | None, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``kernels.inject.shift_and_place`` reads for a stored block: (src [L, 2, H, N, D], scale broadcastable
    to it). No arithmetic on values here: the kernel applies the scale."""
    if kv_dtype == "int4":
        lo = (kv & 0x0F).to(torch.int8) - 8
        hi = (kv >> 4).to(torch.int8) - 8
        codes = torch.stack((lo, hi), dim=-1).flatten(-2)  # [L, 2, H, N, D]
        g = codes.shape[-1] // scale.shape[-1]
        return codes, scale.repeat_interleave(g, dim=-1)
    if kv_dtype == "fp8" and kv.is_cuda and torch.cuda.get_device_capability(kv.device) < (8, 9):
        kv = kv.to(torch.float16)  # no fp8 loads before sm_89; every e4m3 value is exact in fp16
    return kv, scale


def check_layout(kv_dtype: str, kv_torch_dtype: torch.dtype, kv_shape: tuple[int, ...],
                 scale_shape: tuple[int, ...] | None, *, source: str) -> None:
    """A blob's tensors agree with its ``kv_dtype``: BlobCorruptError otherwise (unknown format included), so a
    block is never read in the wrong format."""
    if kv_dtype not in KV_DTYPES:
        raise BlobCorruptError(f"{source}: unknown kv dtype {kv_dtype!r}")
    if kv_dtype == "bf16":
        if not kv_torch_dtype.is_floating_point or kv_torch_dtype == FP8_DTYPE or scale_shape is not None:
            raise BlobCorruptError(f"{source}: kv dtype bf16 needs a float kv and no scale")
        return
    if kv_torch_dtype != STORED_DTYPE[kv_dtype] or scale_shape is None or len(kv_shape) != 5:
        raise BlobCorruptError(f"{source}: kv dtype {kv_dtype} needs {STORED_DTYPE[kv_dtype]} kv and a scale")
    lead = tuple(kv_shape[:4])
    if kv_dtype == "int4":
        d = kv_shape[4] * 2
        ok = len(scale_shape) == 5 and tuple(scale_shape[:4]) == lead and scale_shape[4] > 0 and d % scale_shape[4] == 0
    else:
        ok = tuple(scale_shape) == (*lead, 1)
    if not ok:
        raise BlobCorruptError(f"{source}: kv_scale shape {tuple(scale_shape)} does not fit {kv_dtype} kv "
                               f"{tuple(kv_shape)}")


def stored_bytes_per_token(kv_dtype: str, *, layers: int, kv_heads: int, head_dim: int,
                           float_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one token's K/V take in ``kv_dtype`` (values and scales) for a model of that shape: measured on what
    ``quantize`` stores for one zero token, so a change of layout (a leaner int4) changes every plan with it."""
    check_kv_dtype(kv_dtype)
    if min(layers, kv_heads, head_dim) < 1:
        raise ConfigError(f"model shape: layers {layers}, kv heads {kv_heads}, head_dim {head_dim} must be positive")
    kv, scale = quantize(torch.zeros(1, 2, 1, 1, head_dim, dtype=float_dtype), kv_dtype)
    per_head_layer = kv.nbytes + (0 if scale is None else scale.nbytes)
    return layers * kv_heads * per_head_layer
