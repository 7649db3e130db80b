"""Injection: gather memory tokens from a source buffer → dequantize → rotate keys by Δ → write into a cache.

One operation, two implementations with the same signature:
  ``inject_reference``  torch, built on ``rope.rope_shift``: the oracle, and the CPU path.
  ``inject_triton``     one fused Triton launch per layer group (``inject_triton.py``), used on CUDA.
``shift_and_place`` picks between them: Triton when the tensors are on CUDA and triton imports, torch otherwise.

Shapes (one call = one layer group: one θ, so one ``inv_freq``):
  src       [L_src, 2, H, N_src, D]  a tier/staging buffer: blocks concatenated along tokens. Any float dtype, or
                                     int8 with ``scale``.
  scale     optional, broadcastable to src (e.g. [L_src, 2, H, N_src, 1] per token, [L_src, 2, H, 1, D] per
                                     channel): dequantized value = src · scale, in float32.
  dst       contiguous cache layout  [L_dst, 2, H, N_dst, D], or
            paged pool               [num_pages, L_dst, 2, H, tokens_per_page, D] (TensorRT-LLM's KV pool,
                                     ``KvCacheConnectorWorker.register_kv_caches`` tensor viewed 6-d), with
                                     ``page_table`` mapping a sequence's page number to a pool page.
  src_layers / dst_layers [G]        layer j of the group reads src layer src_layers[j], writes dst_layers[j]
  src_tokens / dst_positions / deltas [T]   token t reads src token src_tokens[t], lands at sequence position
                                     dst_positions[t], its key rotated by deltas[t] (0: copied as is).
Keys rotate in float32 with angles Δ·θ computed in float64 (exact for Δ up to ~1e5, as ``rope.shift_cos_sin``);
values are only dequantized and cast. ``dst`` is written in place and returned.
"""

from __future__ import annotations

import functools
import os

import torch

from inferscale.kernels.inject_checks import as_index, check_inject_args
from inferscale.kernels.rope import rope_shift


def _as_slice(idx: torch.Tensor) -> slice | None:
    """``idx`` as a slice when it is one ascending run (a view, not a gather), else None."""
    n = idx.numel()
    if n == 0 or int(idx[-1]) - int(idx[0]) != n - 1 or (n > 1 and not bool((idx.diff() == 1).all())):
        return None
    return slice(int(idx[0]), int(idx[0]) + n)


def _take(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """``t.index_select(dim, idx)``, as a view when ``idx`` is one ascending run."""
    run = _as_slice(idx)
    return t.index_select(dim, idx) if run is None else t.narrow(dim, run.start, run.stop - run.start)


def inject_reference(src: torch.Tensor, dst: torch.Tensor, *, src_layers, dst_layers, src_tokens, dst_positions,
                     deltas, inv_freq: torch.Tensor, scale: torch.Tensor | None = None, page_table=None,
                     tokens_per_page: int | None = None, move_values: bool = True) -> torch.Tensor:
    """Torch oracle: the same result as the fused kernel, one step at a time."""
    check_inject_args(src, dst, src_layers=src_layers, dst_layers=dst_layers, src_tokens=src_tokens,
                      dst_positions=dst_positions, deltas=deltas, inv_freq=inv_freq, scale=scale,
                      page_table=page_table, tokens_per_page=tokens_per_page)
    dev = src.device
    sl, tok = as_index(src_layers, dev), as_index(src_tokens, dev)
    picked = _take(_take(src, 0, sl), 3, tok)  # [G, 2, H, T, D]
    if scale is not None:
        # Select along the dims the scale really has; broadcasting does the rest (no src-sized float copy).
        sc = scale.to(dev).reshape((1,) * (src.dim() - scale.dim()) + tuple(scale.shape))
        sc = _take(sc, 0, sl) if sc.shape[0] > 1 else sc
        sc = _take(sc, 3, tok) if sc.shape[3] > 1 else sc
        picked = picked.to(torch.float32) * sc.to(torch.float32)
    else:
        picked = picked.to(torch.float32, copy=True)  # never a view of src: dst may be src
    keys = rope_shift(picked[:, 0], as_index(deltas, torch.device("cpu")), inv_freq)  # float32 in, float32 out
    vals = picked[:, 1]
    pos = as_index(dst_positions, dst.device)
    dl = as_index(dst_layers, torch.device("cpu"))
    if page_table is None and (runs := (_as_slice(dl), _as_slice(pos))) and None not in runs:
        # Contiguous layers and positions (the engine's case): one strided write instead of one per layer.
        dst[runs[0], 0, :, runs[1]] = keys.to(dst.device, dst.dtype)
        if move_values:
            dst[runs[0], 1, :, runs[1]] = vals.to(dst.device, dst.dtype)
        return dst
    for j, li in enumerate(dl.tolist()):
        if page_table is None:
            dst[li, 0, :, pos] = keys[j].to(dst.device, dst.dtype)
            if move_values:
                dst[li, 1, :, pos] = vals[j].to(dst.device, dst.dtype)
        else:
            pages = as_index(page_table, dst.device)[pos // tokens_per_page]
            off = pos % tokens_per_page
            # pool[page, layer, kv, :, off] for each token: advanced indexing puts the token axis first.
            dst[pages, li, 0, :, off] = keys[j].transpose(0, 1).to(dst.device, dst.dtype)
            if move_values:
                dst[pages, li, 1, :, off] = vals[j].transpose(0, 1).to(dst.device, dst.dtype)
    return dst


@functools.cache
def triton_available() -> bool:
    """True when the Triton kernel can run: triton imports (CUDA wheels ship it; CPU wheels do not)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ---- selection: the one place that decides Triton vs torch (the engine and the TRT-LLM worker call these) ----
def shift_and_place(src: torch.Tensor, dst: torch.Tensor, **kw) -> torch.Tensor:
    """``inject`` on the best path: the fused Triton kernel when ``dst`` is on CUDA and triton imports, else the
    torch reference. ``INFERSCALE_INJECT=torch`` forces the reference (a kill switch for a kernel bug)."""
    if dst.is_cuda and triton_available() and os.environ.get("INFERSCALE_INJECT", "") != "torch":
        from inferscale.kernels.inject_triton import inject_triton

        return inject_triton(src, dst, **kw)
    return inject_reference(src, dst, **kw)


def rotate_in_place(kv: torch.Tensor, first: int, delta: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Rotate the keys of tokens ``first``.. of a cache-layout buffer ``kv`` [G, 2, H, N, D] by ``delta`` [N-first].

    The engine's call (``engine/cache.py``): on CPU exactly the old ``rope_shift`` in place; on CUDA the fused
    kernel reading and writing the same buffer (each program reads a token's key before writing it)."""
    if kv.is_cuda and triton_available() and os.environ.get("INFERSCALE_INJECT", "") != "torch":
        layers = list(range(kv.shape[0]))
        tokens = torch.arange(first, kv.shape[3])
        shift_and_place(kv, kv, src_layers=layers, dst_layers=layers, src_tokens=tokens, dst_positions=tokens,
                        deltas=delta, inv_freq=inv_freq, move_values=False)
        return
    rope_shift(kv[:, 0, :, first:], delta, inv_freq, inplace=True)
