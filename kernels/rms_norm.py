"""``rms_norm(x, weight, eps)``: Gemma-3's RMSNorm of bf16 rows in one call, aten's numbers (``rms_norm.cpp``);
``qk_norm_rope``: a layer's q and k normalized, rotated and split in one call, the lean layer's numbers.

``torch.nn.functional.rms_norm`` on the CPU is a composite of ~25 dispatched operations, ~50-70 us a call on the
2-core machine; a decode step of Gemma-3-270M makes 91 of them (issue 22). The kernel runs the same float32
operations in aten's own order (its cascade sum included), so its outputs are the composite's bit for bit.

``load()`` returns the operator only after checking that on this machine (random rows of the widths Gemma uses, a
weight per row and a weight per head): aten's vector width or sum order could differ elsewhere. None, and the
lean layers keep aten's composite, where it differs, where the build fails, or with ``INFERSCALE_RMS_NORM=0``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from inferscale.kernels import cppext

SOURCE = Path(__file__).with_name("rms_norm.cpp")
# No -march: aten's order is reproduced with plain arrays; no contraction: v * v is rounded before it is summed.
# OpenMP: at::parallel_for hands runs of rows to torch's threads (a prompt pass's rows; a decode step's few run inline).
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
CHECK_WIDTHS = (640, 256, 1152, 2048, 100, 7)  # Gemma-3 hidden and head sizes, and widths with scalar tails

RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What the kernel computes, through aten's composite: bf16 ``x`` normalized in float32, times ``weight``."""
    if weight.dim() == 1:
        return torch.nn.functional.rms_norm(x.float(), weight.shape, weight, eps).type_as(x)
    return (torch.nn.functional.rms_norm(x.float(), x.shape[-1:], None, eps) * weight).type_as(x)


def agrees(op: RmsNorm, rows: int = 64) -> bool:
    """The kernel's outputs equal ``reference``'s on random rows of CHECK_WIDTHS, per-row and per-head weights."""
    gen = torch.Generator().manual_seed(0)
    for width in CHECK_WIDTHS:
        for scale in (1.0, 30.0, 1e-3):
            x = (torch.randn(rows, width, generator=gen) * scale).to(torch.bfloat16)
            w = 1.0 + torch.randn(width, generator=gen) * 0.1
            if not torch.equal(op(x, w, 1e-6), reference(x, w, 1e-6)):
                return False
        heads = torch.randn(2, 3, 5, width, generator=gen).to(torch.bfloat16).transpose(1, 2)  # [B, H, q, D]
        per_head = 1.0 + torch.randn(5, 1, width, generator=gen) * 0.1
        if not torch.equal(op(heads, per_head, 1e-6), reference(heads, per_head, 1e-6)):
            return False
    return True


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``reference``'s numbers: through the kernel where it takes ``x`` (bf16, each row's values adjacent: aten
    sums another layout in another order) and is used here, else aten's composite."""
    fused = load()
    if fused is not None and x.dtype == torch.bfloat16 and x.stride(-1) == 1:
        return fused(x, weight, eps)
    return reference(x, weight, eps)


def qk_reference(qk: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, signed_sin: torch.Tensor,
                 heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lean layer's q/k step through aten: ``qk`` [B, q, G, D] (q's heads, then k's) normalized per head
    (``weight`` [G, 1, D]), rotated (``roll(x, D/2) * signed_sin`` is ``rotate_half(x) * sin``), split into
    contiguous query [B, heads, q, D] and key [B, G - heads, q, D] (SDPA takes another path for strided inputs)."""
    x = norm(qk.transpose(1, 2), weight, eps)
    x = (x * cos) + (torch.roll(x, x.shape[-1] // 2, -1) * signed_sin)
    return x[:, :heads].contiguous(), x[:, heads:].contiguous()


def qk_norm_rope(qk: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, signed_sin: torch.Tensor,
                 heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_reference``'s numbers, in one call of ``rms_norm.cpp`` where it is built and agrees here (bf16)."""
    fused = load_qk()
    if fused is not None and qk.dtype == torch.bfloat16 and qk.stride(-1) == 1 and cos.dim() == 4:
        query, key = fused(qk, weight, eps, cos, signed_sin, heads)
        return query, key
    return qk_reference(qk, weight, eps, cos, signed_sin, heads)


def qk_agrees(op: Callable) -> bool:
    """``op`` gives ``qk_reference``'s outputs on random q/k rows: Gemma-3-270M's head size and a small one, one
    and several tokens, two sequences, q/k as a slice of a wider q/k/v product (as the lean layer hands them)."""
    gen = torch.Generator().manual_seed(1)
    # (1, 44, ...): a prompt pass's rows, which threads share
    for batch, length, groups, heads, d in ((1, 1, 5, 4, 256), (2, 5, 5, 4, 256), (3, 7, 6, 4, 64), (1, 44, 5, 4, 256)):
        wide = (torch.randn(batch, length, (groups + 2) * d, generator=gen) * 3).to(torch.bfloat16)
        qk = wide[..., : groups * d].reshape(batch, length, groups, d)
        weight = 1.0 + torch.randn(groups, 1, d, generator=gen) * 0.1
        tables = 1 if batch == 3 else batch  # one table row for every sequence, as the model's own forward has it
        cos = torch.randn(tables, 1, length, d, generator=gen).to(torch.bfloat16)
        sin = torch.randn(tables, 1, length, d, generator=gen).to(torch.bfloat16)
        got, want = op(qk, weight, 1e-6, cos, sin, heads), qk_reference(qk, weight, 1e-6, cos, sin, heads)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            return False
    return True


@functools.cache
def load_qk() -> Callable | None:
    """``rms_norm.cpp``'s ``qk_norm_rope``, where ``load()`` gives the norm and the q/k step agrees here too."""
    if load() is None:
        return None
    return cppext.checked(torch.ops.inferscale_norm.qk_norm_rope, qk_agrees,
                          "qk_norm_rope kernel differs from the lean layer's operations here; those are used")


@functools.cache
def load() -> RmsNorm | None:
    """The kernel, built on first use and checked against aten here; None where it cannot be used."""
    if not cppext.built(SOURCE, FLAGS, "INFERSCALE_RMS_NORM"):
        return None
    return cppext.checked(torch.ops.inferscale_norm.rms_norm, agrees,
                          "rms_norm kernel differs from aten's rms_norm on this machine; the composite is used")


if __name__ == "__main__":  # scripts/setup.sh builds it ahead of the first model load
    logging.basicConfig(level=logging.INFO)
    print("rms_norm:", "built" if load() is not None else "not used here (aten's composite is)",
          cppext.build_dir(SOURCE, FLAGS))
