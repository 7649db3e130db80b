"""``avx2_linear(weight, x)``: a bf16 model's products on AVX2 CPUs without AVX512-BF16 (``avx2_linear.cpp``).

There aten computes a bf16 linear as one float32 dot product per output (its AVX2 ``dot_with_fp32_arith``): fast
enough for one row (the LM head of Gemma-3-270M 18.6 ms), but it re-reads and re-converts each weight row for every
row of x, so 16 rows take 24x one row (the head 272 ms) and a 600-token prompt's q/k/v 59 ms. This kernel does the
same arithmetic (the same 64 chains, the same reduction tree, so the same bits) with the weight converted once per
register block of up to six rows: 16 rows of the head 51 ms, the 600-token q/k/v 11 ms (2-core Zen 3). It takes any
number of rows: each row's outputs are F.linear's for that row alone, at every row count (F.linear's own results do
not change with the row count here either; ``weightmajor`` checks both before using it).
Built once per machine as a torch C++ extension into InferScale's cache (``cppext``).

The same source screens the LM head in int8 for greedy steps (``screen_ops``: x as one int16 row against the int8
head widened as it loads, ``vpmaddwd``, exact int32 sums; the method and its bounds are ``greedy_screen.h``'s, shared
with the AVX512 and AMX kernels; used by ``models/greedyhead.py``).

``load()`` returns None, and the model keeps aten, on a CPU without AVX2 and FMA, where the build fails, or with
``INFERSCALE_AVX2_LINEAR=0``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from inferscale.cpuflags import cpu_flags
from inferscale.kernels import cppext

SOURCE = Path(__file__).with_name("avx2_linear.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
CHAINS = 64  # aten's 8 accumulators x 8 lanes: in-features must be a multiple


def build_dir() -> Path:
    return cppext.build_dir(SOURCE, FLAGS)


@functools.cache
def load() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``product(weight, x)``, the kernel built on first use (later processes load the cached build); None where it
    cannot run here."""
    return product if cppext.built(SOURCE, FLAGS if {"avx2", "fma"} <= cpu_flags() else None,
                                   "INFERSCALE_AVX2_LINEAR") else None


def screen_ops() -> tuple[Callable, Callable] | None:
    """``(screen_pack, greedy_screen)`` (``avx2_linear.cpp``): ``screen_pack(weight)`` -> [packed head (int8, 8 rows a
    vector, two in-features a 16-bit word), stats], ``greedy_screen(*packed, x)`` -> [n, 2] candidates; None where the
    kernel is not built here."""
    if load() is None:
        return None
    return torch.ops.inferscale_avx2.screen_pack, torch.ops.inferscale_avx2.greedy_screen


def screen_rows() -> int:
    """Rows of x one ``greedy_screen`` call takes: up to 16, one int16 row each."""
    return int(torch.ops.inferscale_avx2.greedy_screen_rows()) if load() is not None else 0


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``weight``: bf16 [out, in] on the CPU, contiguous, in-features a multiple of 64
    (aten's dot then has no tail, whose order this kernel does not reproduce); any out-features (the last group of
    16 is padded)."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.is_contiguous() and weight.shape[1] % CHAINS == 0)


def product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` [rows, out] (bf16, contiguous) for a bf16 ``weight`` [out, in] and ``x`` [rows, in]."""
    return torch.ops.inferscale_avx2.avx2_linear(packed(weight), x, weight.shape[0])


def packed(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in the kernel's layout (``avx2_pack``: groups of 16 outputs, chain by chain), kept on the tensor
    (``cppext.kept_packing``)."""
    return cppext.kept_packing(weight, "inferscale_avx2_packed", torch.ops.inferscale_avx2.avx2_pack)


if __name__ == "__main__":  # scripts/setup.sh builds it ahead of the first model load
    logging.basicConfig(level=logging.INFO)
    print("avx2_linear:", "built" if load() is not None else "not available here (aten is used)", build_dir())
