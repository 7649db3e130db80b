"""``rms_norm(x, weight, eps)``: Gemma-3's RMSNorm of bf16 rows in one call, aten's numbers (``rms_norm.cpp``).

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
import os
from collections.abc import Callable
from pathlib import Path

import torch

from inferscale.kernels import cppext

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("rms_norm.cpp")
# No -march: aten's order is reproduced with plain arrays; no contraction: v * v is rounded before it is summed.
FLAGS = ["-O3", "-ffp-contract=off"]
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


@functools.cache
def load() -> RmsNorm | None:
    """The kernel, built on first use and checked against aten here; None where it cannot be used."""
    if os.environ.get("INFERSCALE_RMS_NORM", "1") == "0" or not cppext.build(SOURCE, FLAGS):
        return None
    op = torch.ops.inferscale_norm.rms_norm
    with torch.inference_mode():
        if not agrees(op):
            log.warning("rms_norm kernel differs from aten's rms_norm on this machine; the composite is used")
            return None
    return op


if __name__ == "__main__":  # scripts/setup.sh builds it ahead of the first model load
    logging.basicConfig(level=logging.INFO)
    print("rms_norm:", "built" if load() is not None else "not used here (aten's composite is)",
          cppext.build_dir(SOURCE, FLAGS))
