"""``f32_linear``: float32 linears of a few rows on AVX2 and FMA CPUs (``f32_linear.cpp``), for the retrieval
embedder's query (issue 22: every request embeds its question before anything else happens, so this is fixed cost in
every mode's first token).

aten runs a float32 linear through MKL, which on the 2-core AMD Zen 3 machine did MiniLM's six linears per layer for
a 23-token query in ~1.1 ms a layer (27-40 G multiply-adds/s; oneDNN's ``_linear_pointwise``: ~0.8 ms); the kernel,
a 6-row x 16-output register tile over a weight packed once, in ~0.6 ms (57-84 G/s): ~3.5 of the query embedding's
12-13 ms. Its sums run in another order than MKL's (blocks of 128 in-features, like a BLAS), so its outputs are not
MKL's bits: ``load()`` hands it out only after checking that its error against float64 is no larger than aten's
(``ERROR_RATIO``). None, and the linears stay aten's, on CPUs without AVX2 and FMA, where the build fails, where the
check fails, or with ``INFERSCALE_F32_LINEAR=0``.

``install(model)`` puts it under every ``nn.Linear`` of a float32 CPU model for passes of up to ``MAX_ROWS`` rows (a
query batch); longer passes (memories embedded at upload, 64 texts a batch) keep aten's. A row's output does not
depend on the other rows or on the thread count, so a query gets the same embedding alone or in a batch of the same
padded length, on the engine's thread (every core, when the server is idle: server/memories.py) or a side thread
(one core; its products split over OpenMP's own count for the calling thread, never at::parallel_for's, which
gave a pinned side thread a pool of its own: tests/kernels/test_f32_linear.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from inferscale.cpuflags import cpu_flags
from inferscale.kernels import cppext

SOURCE = Path(__file__).with_name("f32_linear.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
MAX_ROWS = 256  # rows a pass hands the kernel; past this, aten's MKL product (its blocking pays at many rows)
ERROR_RATIO = 1.5  # its max error against float64 may exceed aten's by at most this factor
CHECK_SHAPES = ((384, 384), (1536, 384), (384, 1536), (17, 70))  # MiniLM's, and a ragged one

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]


@functools.cache
def load() -> tuple[Callable[[torch.Tensor], torch.Tensor], Product] | None:
    """(pack, product) once built and checked here; None where aten's linears stay."""
    if not cppext.built(SOURCE, FLAGS if {"avx2", "fma"} <= cpu_flags() else None, "INFERSCALE_F32_LINEAR"):
        return None
    ops = torch.ops.inferscale_f32.f32_pack, torch.ops.inferscale_f32.f32_linear
    return cppext.checked(ops, lambda pair: agrees(*pair),
                          "f32_linear's error exceeds aten's here; the embedder keeps aten's linears")


def agrees(pack: Callable[[torch.Tensor], torch.Tensor], product: Product) -> bool:
    """Max error against float64 within ERROR_RATIO of aten's on CHECK_SHAPES, 1 to 23 rows, with and without bias."""
    gen = torch.Generator().manual_seed(0)
    for out, inp in CHECK_SHAPES:
        w = torch.randn(out, inp, generator=gen) * inp ** -0.5
        b = torch.randn(out, generator=gen)
        for rows in (1, 5, 23):
            x = torch.randn(rows, inp, generator=gen)
            for bias in (b, None):
                exact = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
                err = (product(pack(w), x, bias, out).double() - exact).abs().max()
                aten = (torch.nn.functional.linear(x, w, bias).double() - exact).abs().max()
                if not err <= ERROR_RATIO * aten + 1e-7:
                    return False
    return True


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear``'s forward through the kernel (its weight packed once) for up to MAX_ROWS rows, else aten's."""

    def __init__(self, linear: torch.nn.Linear, ops: tuple[Callable[[torch.Tensor], torch.Tensor], Product]) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.out_features, self.in_features = linear.out_features, linear.in_features
        self._product = ops[1]
        self.register_buffer("packed", ops[0](linear.weight.detach()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > MAX_ROWS or rows == 0 or x.dtype != torch.float32 or (torch.is_grad_enabled() and x.requires_grad):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        out = self._product(self.packed, x.reshape(rows, self.in_features), self.bias, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)


def install(model: torch.nn.Module) -> int:
    """Every ``nn.Linear`` of a float32 CPU ``model`` through the kernel (PackedLinear); the number replaced (0 where
    the kernel is not used here)."""
    ops = load()
    if ops is None:
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32
             and child.weight.device.type == "cpu"]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, ops))
    return len(swaps)


if __name__ == "__main__":  # scripts/setup.sh builds it ahead of the first server start
    print("f32_linear:", "built" if load() is not None else "not available here (aten's linears are used)",
          cppext.build_dir(SOURCE, FLAGS))
