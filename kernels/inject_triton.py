"""The fused injection kernel: gather → dequantize → rotate keys by Δ (float32) → write, one launch per layer group.

Same contract as ``inject.inject_reference`` (see ``inject.py`` for shapes); tests run it under
``TRITON_INTERPRET=1`` on CPU against that oracle. Imported only where triton is installed.

Grid: (token tiles, group layers × heads). A program loads BLOCK_T tokens × the two halves of head_dim for one
(layer, head), for K then V, so it reads each element once and writes it once. Both cache layouts are one
addressing rule: position p lands in page ``page_table[p // tokens_per_page]`` at offset ``p % tokens_per_page``;
the contiguous cache is a single page as long as the sequence (page stride 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferscale.kernels.inject_checks import as_index, check_inject_args

BLOCK_T = 16  # tokens per program: memory blocks are tens of tokens; small tiles keep odd lengths cheap


@triton.jit
def _to_out(x, out_ty: tl.constexpr):
    """Cast float32 → the cache dtype, rounding to nearest even. For bf16 the rounding is done on the bits first:
    Triton's interpreter truncates float32 → bf16, the GPU rounds; a pre-rounded value casts the same on both."""
    if out_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(out_ty)


@triton.jit
def _inject_kernel(
    src, scale, dst, src_layers, dst_layers, src_tokens, dst_positions, rot_rows, cos_tab, sin_tab, page_table,
    n_tokens, n_heads, half, tokens_per_page,
    ss_l, ss_kv, ss_h, ss_t, ss_d,  # src strides
    cs_l, cs_kv, cs_h, cs_t, cs_d,  # scale strides (0 along broadcast dims)
    ds_p, ds_l, ds_kv, ds_h, ds_t, ds_d,  # dst strides (ds_p = 0 for the contiguous layout)
    HAS_SCALE: tl.constexpr, MOVE_VALUES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_lh = tl.program_id(1)
    j = pid_lh // n_heads
    h = pid_lh % n_heads
    sl = tl.load(src_layers + j).to(tl.int64)
    dl = tl.load(dst_layers + j).to(tl.int64)

    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n_tokens
    st = tl.load(src_tokens + t, mask=tmask, other=0).to(tl.int64)
    pos = tl.load(dst_positions + t, mask=tmask, other=0).to(tl.int64)
    row = tl.load(rot_rows + t, mask=tmask, other=0).to(tl.int64)
    page = tl.load(page_table + pos // tokens_per_page, mask=tmask, other=0).to(tl.int64)
    off = pos % tokens_per_page

    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    m = tmask[:, None] & dmask[None, :]
    d64 = d.to(tl.int64)

    s_tok = sl * ss_l + h * ss_h + st[:, None] * ss_t
    lo = s_tok + d64[None, :] * ss_d  # first half of head_dim
    hi = lo + half * ss_d  # second half
    d_tok = page[:, None] * ds_p + dl * ds_l + h * ds_h + off[:, None] * ds_t
    d_lo = d_tok + d64[None, :] * ds_d
    d_hi = d_lo + half * ds_d

    k1 = tl.load(src + lo, mask=m, other=0.0).to(tl.float32)
    k2 = tl.load(src + hi, mask=m, other=0.0).to(tl.float32)
    if HAS_SCALE:
        c_tok = sl * cs_l + h * cs_h + st[:, None] * cs_t
        k1 = k1 * tl.load(scale + c_tok + d64[None, :] * cs_d, mask=m, other=0.0).to(tl.float32)
        k2 = k2 * tl.load(scale + c_tok + (d64[None, :] + half) * cs_d, mask=m, other=0.0).to(tl.float32)
    cos = tl.load(cos_tab + row[:, None] * half + d64[None, :], mask=m, other=1.0)
    sin = tl.load(sin_tab + row[:, None] * half + d64[None, :], mask=m, other=0.0)
    # k' = k·cos + rotate_half(k)·sin with rotate_half(k) = (-k2, k1): the reference's order of operations.
    out1 = k1 * cos - k2 * sin
    out2 = k2 * cos + k1 * sin
    tl.store(dst + d_lo, _to_out(out1, dst.dtype.element_ty), mask=m)
    tl.store(dst + d_hi, _to_out(out2, dst.dtype.element_ty), mask=m)

    if MOVE_VALUES:
        v1 = tl.load(src + lo + ss_kv, mask=m, other=0.0).to(tl.float32)
        v2 = tl.load(src + hi + ss_kv, mask=m, other=0.0).to(tl.float32)
        if HAS_SCALE:
            c_tok = sl * cs_l + cs_kv + h * cs_h + st[:, None] * cs_t
            v1 = v1 * tl.load(scale + c_tok + d64[None, :] * cs_d, mask=m, other=0.0).to(tl.float32)
            v2 = v2 * tl.load(scale + c_tok + (d64[None, :] + half) * cs_d, mask=m, other=0.0).to(tl.float32)
        tl.store(dst + d_lo + ds_kv, _to_out(v1, dst.dtype.element_ty), mask=m)
        tl.store(dst + d_hi + ds_kv, _to_out(v2, dst.dtype.element_ty), mask=m)


def rotation_table(deltas: torch.Tensor, inv_freq: torch.Tensor, device: torch.device):
    """(row of each token, cos table, sin table): trigonometry once per distinct Δ, angles in float64 as the
    reference does, so the kernel's float32 rotation matches it to rounding."""
    uniq, rows = torch.unique(deltas.to(torch.long).cpu(), return_inverse=True)
    angles = uniq.to(torch.float64)[:, None] * inv_freq.detach().cpu().to(torch.float64)[None, :]
    cos = angles.cos().to(torch.float32).to(device).contiguous()
    sin = angles.sin().to(torch.float32).to(device).contiguous()
    return rows.to(torch.int32).to(device), cos, sin


def inject_triton(src: torch.Tensor, dst: torch.Tensor, *, src_layers, dst_layers, src_tokens, dst_positions,
                  deltas, inv_freq: torch.Tensor, scale: torch.Tensor | None = None, page_table=None,
                  tokens_per_page: int | None = None, move_values: bool = True) -> torch.Tensor:
    """One launch for a layer group; arguments as ``inject.inject_reference``."""
    check_inject_args(src, dst, src_layers=src_layers, dst_layers=dst_layers, src_tokens=src_tokens,
                      dst_positions=dst_positions, deltas=deltas, inv_freq=inv_freq, scale=scale,
                      page_table=page_table, tokens_per_page=tokens_per_page)
    dev = dst.device
    n_tokens, n_layers = len(src_tokens), len(src_layers)
    if n_tokens == 0 or n_layers == 0:
        return dst
    if src.device != dev:
        raise ValueError(f"inject_triton: src on {src.device}, dst on {dev}; stage src on the device first")
    idx = lambda x: as_index(x, dev).to(torch.int32).contiguous()  # noqa: E731
    rows, cos, sin = rotation_table(as_index(deltas, torch.device("cpu")), inv_freq, dev)
    half, heads = src.shape[4] // 2, src.shape[2]
    if page_table is None:
        dst6 = dst.unsqueeze(0)  # one page holding the whole sequence
        pt, tpp = torch.zeros(1, dtype=torch.int32, device=dev), dst.shape[3]
        ds = (0, *dst.stride())
    else:
        dst6, pt, tpp = dst, idx(page_table), int(tokens_per_page)
        ds = dst.stride()
    if scale is not None:
        sc = scale.to(dev).expand(src.shape)  # stride 0 along the broadcast dims: no copy
        cs = sc.stride()
    else:
        sc, cs = src, (0,) * 5  # never read: HAS_SCALE is off
    grid = (triton.cdiv(n_tokens, BLOCK_T), n_layers * heads)
    _inject_kernel[grid](
        src, sc, dst6, idx(src_layers), idx(dst_layers), idx(src_tokens), idx(dst_positions), rows, cos, sin, pt,
        n_tokens, heads, half, tpp,
        *src.stride(), *cs, *ds,
        HAS_SCALE=scale is not None, MOVE_VALUES=move_values, BLOCK_T=BLOCK_T,
        BLOCK_D=triton.next_power_of_2(half),
        enable_fp_fusion=False,  # no FMA contraction: the GPU rounds as the torch reference does
    )
    return dst
