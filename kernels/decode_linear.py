"""The decode-path product kernel for this CPU (issue 22): ``amx_linear`` where the CPU has AMX-BF16 (Intel Sapphire
Rapids and later), else ``bf16_linear`` where it has AVX512-BF16 (AMD Zen 4 and later), else ``avx2_linear`` where
it has AVX2 and FMA (AMD Zen 2/3, older Intel), else None (aten stays).

Each computes ``x @ weight.T`` [rows, out] for a bf16 ``weight`` [out, in] (``fits``), each output row depending
only on its own input row; ``weightmajor`` checks each against F.linear before using it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from inferscale.kernels import amx_linear, avx2_linear, bf16_linear


def load() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    return amx_linear.load() or bf16_linear.load() or avx2_linear.load()


def fits(weight: torch.Tensor) -> bool:
    """Whether this CPU's kernel takes ``weight`` (the AVX512 kernels share AMX's operand rule)."""
    return avx2_linear.fits(weight) if load() is avx2_linear.product else amx_linear.fits(weight)


def max_rows() -> int:
    """The most rows a pass should hand the kernel (past them F.linear): every count on AVX2, where aten's bf16
    product is slow at every count past one row (avx2_linear.py); the scheduler's 128-token prompt chunk on
    AVX512-BF16 (``bf16_linear.MAX_ROWS``); 64 on AMX, past which oneDNN's AMX matmul wins."""
    kernel = load()
    if kernel is avx2_linear.product:
        return sys.maxsize
    return bf16_linear.MAX_ROWS if kernel is bf16_linear.product else amx_linear.MAX_ROWS


def screen_ops() -> tuple[Callable, Callable] | None:
    """The LM head's int8 screen (``greedy_screen.h``) on the same kernel as the products: ``screen_pack(weight)`` ->
    a list of tensors, ``greedy_screen(*packed, x)`` -> [n, 2] candidates; None where that kernel has none."""
    if amx_linear.load() is not None:
        return amx_linear.screen_ops()
    return bf16_linear.screen_ops() if bf16_linear.load() is not None else avx2_linear.screen_ops()


def screen_rows() -> int:
    """The most rows of x one ``greedy_screen`` call takes where it pays: 16 on the VNNI kernel (its wide screen, one
    int8 row of x each, from 5 rows) and on the AVX2 one (one int16 row each), 4 on AMX (its tiles past that cost
    more than the bf16 head: 16 rows 30 vs 23 ms)."""
    if amx_linear.load() is not None:
        return amx_linear.SCREEN_ROWS
    return bf16_linear.screen_rows() if bf16_linear.load() is not None else avx2_linear.screen_rows()


def screen_groups() -> bool:
    """Whether more rows than ``screen_rows()`` are screened in calls of at most that many (then the rest) instead of
    reading the full bf16 head: on the VNNI and AVX2 kernels a screen costs less a row than the head at every count
    (Zen 4, 2026-12-05, real Gemma-3-270M hidden rows, medians of 9: 24 rows 22.8 -> 15.3 ms, 32 rows 28.0 -> 16.8,
    48 rows 35.5 -> 23.6, 17 rows 14.9 -> 13.2); not on AMX, whose screen past 4 rows costs more than the head."""
    return amx_linear.load() is None


def rows_argmax() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Each bf16 logits row's first maximum, as ``max(dim=-1).indices`` (``bf16_linear.rows_argmax``), where the
    products run on ``bf16_linear``; None elsewhere (the AMX kernel's machines do not build that file)."""
    return bf16_linear.rows_argmax() if load() is bf16_linear.product else None


def rescorer() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``rescore(weight, x, candidates)``: chosen elements of ``load()(weight, x)`` bit for bit, computed alone
    (``bf16_linear.rescore``), where the products run on ``bf16_linear``; None elsewhere (there the candidates' rows
    are gathered and multiplied by the product kernel)."""
    return bf16_linear.rescore if load() is bf16_linear.product else None


def prepare(weight: torch.Tensor) -> None:
    """Ready ``weight`` for the kernel now rather than at its first product: ``bf16_linear`` and ``avx2_linear``
    pack a copy (kept on the tensor); the AMX kernel reads the weight as it is."""
    if load() is bf16_linear.product:
        bf16_linear.packed(weight)
    elif load() is avx2_linear.product:
        avx2_linear.packed(weight)
