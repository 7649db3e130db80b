"""``gelu_tanh_mul(gate_up, inter)``: Gemma-3's MLP activation, ``gelu(gate, approximate="tanh") * up`` of the fused
gate/up product's rows, in one call (``gelu_mul.cpp``), aten's numbers bit for bit.

aten's gelu and the mul after it cost a 16-row decode step of Gemma-3-270M ~1.2 ms (18 layers, two dispatched calls
each, the gelu reading a strided half of the product); the kernel runs aten's own bf16 product in one pass, with
aten's gelu looked up by the gate's 16 bits in a table aten's own vectorized gelu fills once (its headers, compiled at
the CPU capability torch runs here): 18 calls of 16 rows 0.3 ms, of a 64-token chunk 0.9 (Sleef's tanh per value:
0.7-1.2 and 2.7-2.8).

``load()`` returns the operator only after checking it equals aten's two calls on this machine (random rows at
several scales, the layouts the lean layers hand it). None, and the lean layers keep aten's calls, where torch runs
another capability than the two builds here, where the build or the check fails, or with ``INFERSCALE_GELU_MUL=0``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from inferscale.kernels import cppext

SOURCE = Path(__file__).with_name("gelu_mul.cpp")
# aten's vector classes at the capability its own kernels were dispatched to here (torch.backends.cpu)
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
CHECK_SHAPES = ((1, 2048), (16, 2048), (3, 7, 64), (40, 2048))  # rows x inter: decode, a question's pass, others

GeluMul = Callable[[torch.Tensor, int], torch.Tensor]


def flags() -> list[str] | None:
    """The build for the capability torch runs its kernels at here; None for others (aten's calls stay)."""
    extra = CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability())
    return None if extra is None else ["-O3", *extra, "-fopenmp"]


def reference(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """What the kernel computes, through aten: the lean layer's ``gelu(gate) * up``."""
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def agrees(op: GeluMul) -> bool:
    """The kernel's outputs equal ``reference``'s on random gate/up rows of CHECK_SHAPES at several scales."""
    gen = torch.Generator().manual_seed(0)
    for *rows, inter in CHECK_SHAPES:
        for scale in (1.0, 8.0, 1e-2):
            gate_up = (torch.randn(*rows, 2 * inter, generator=gen) * scale).to(torch.bfloat16)
            if not torch.equal(op(gate_up, inter), reference(gate_up, inter)):
                return False
    return True


INTER_MULTIPLE = 32  # the C++'s kInterMultiple: whole vectors in either build


def fits(inter: int) -> bool:
    """Whether the kernel takes this intermediate size (whole vectors in either build)."""
    return inter % INTER_MULTIPLE == 0


@functools.cache
def load() -> GeluMul | None:
    """The operator once built and checked here; None where the lean layers keep aten's calls."""
    build = flags()
    if not cppext.built(SOURCE, build, "INFERSCALE_GELU_MUL"):
        return None
    return cppext.checked(torch.ops.inferscale_gelu.gelu_tanh_mul, agrees,
                          "gelu_tanh_mul differs from aten's gelu and mul here; those are used")


if __name__ == "__main__":  # scripts/setup.sh builds it ahead of the first model load
    logging.basicConfig(level=logging.INFO)
    print("gelu_mul:", "built" if load() is not None else "not used here (aten's gelu and mul are)",
          cppext.build_dir(SOURCE, flags() or []))
