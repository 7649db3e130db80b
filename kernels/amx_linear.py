"""``amx_linear(weight, x)``: decode's few-row products on AMX over every torch thread (``amx_linear.cpp``); the same
tiles in int8 screen the LM head for greedy decoding (``screen_ops``, used by ``models/greedyhead.py``).

Built once per machine as a torch C++ extension (gcc and ninja; ~15 s) into InferScale's cache, keyed by the source
and the torch version, and registered as ``torch.ops.inferscale_cpu.amx_linear``. Why our own kernel and not a
library's: oneDNN's matmul for these shapes (``W @ x.T``, the weight read in place) runs on one thread and reads
the layer weights at about half the machine's bandwidth; no other stock CPU kernel reads them faster (issue 22's
note: oneDNN prepacked, bmm blocks, int8 packs). The kernel does oneDNN's arithmetic; ``weightmajor`` uses it for a
weight only after checking it gives F.linear's outputs bit for bit there.

``load()`` returns None, and the model keeps oneDNN, on a CPU without AMX-BF16, where the build fails (no
compiler), or with ``INFERSCALE_AMX_LINEAR=0``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from inferscale.cpuflags import cpu_flags
from inferscale.kernels import cppext

SOURCE = Path(__file__).with_name("amx_linear.cpp")
BLOCK = 32  # in-features per tile step: a weight's in-features must be a multiple
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-fopenmp"]

AmxLinear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_dir() -> Path:
    return cppext.build_dir(SOURCE, FLAGS)


@functools.cache
def load() -> AmxLinear | None:
    """The kernel, built on first use (later processes load the cached build); None where it cannot run here."""
    runs_here = "amx_bf16" in cpu_flags() and torch.backends.mkldnn.is_available()
    if not cppext.built(SOURCE, FLAGS if runs_here else None, "INFERSCALE_AMX_LINEAR"):  # else oneDNN is kept
        return None
    return torch.ops.inferscale_cpu.amx_linear


SCREEN_ROWS = 4  # rows of x a screen call takes where it pays (decode_linear.screen_rows)
MAX_ROWS = 64  # the most rows a pass hands the kernel: past them oneDNN's AMX matmul is faster (amx_linear.cpp)


def screen_ops() -> tuple[Callable, Callable] | None:
    """``(screen_pack, greedy_screen)`` (amx_linear.cpp: the LM head's int8 screen for greedy decoding), where the
    kernel is built and the CPU has AMX-INT8 too; else None. ``screen_pack(weight)`` -> [int8 head, stats],
    ``greedy_screen(*packed, x)``."""
    if load() is None or "amx_int8" not in cpu_flags():
        return None
    return torch.ops.inferscale_cpu.screen_pack, torch.ops.inferscale_cpu.greedy_screen


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``weight``: bf16 [out, in] on the CPU, contiguous, in-features a multiple of 32."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.is_contiguous() and weight.shape[1] % BLOCK == 0)


if __name__ == "__main__":  # scripts/setup.sh builds it ahead of the first model load
    logging.basicConfig(level=logging.INFO)
    print("amx_linear:", "built" if load() is not None else "not available here (oneDNN is used)", build_dir())
