"""``bf16_linear(weight, x)``: decode's few-row products on AVX512-BF16 CPUs without AMX (``bf16_linear.cpp``).

oneDNN's kernel for these shapes there (``W @ x.T``, the weight read in place) runs on one thread at ~10 GB/s; the
LM head of Gemma-3-270M alone took 30-35 ms of a 68 ms decode step on the 2-core Zen 4 machine, which reads 34 GB/s.
This kernel does oneDNN's arithmetic (``vdpbf16ps`` pair by pair, in chains of in-features added in order) over every
torch thread. oneDNN's chain length depends on the in-features and on whether there is one row or more (512 for
640 and 1024 in-features; for 2048, 512 with one row and 1024 with more): ``chain`` finds the one it uses for rows
in a batch, per in-features, by comparing with F.linear on random rows, and the kernel uses it for a single row too.
So a row's numbers never depend on what rides along: with oneDNN's one-row chain, a greedy answer decoded alone
and the same request decoded beside another differed (2026-12-06: "The answer is 2011." alone, "2012." in any
batch, Gemma-3-270M, the down projection's 2048 in-features, found by a load probe comparing answers under load
with the same requests alone). ``weightmajor`` uses the kernel for a weight only after checking it gives F.linear's
outputs bit for bit on that weight, a single row against F.linear's for that row in a batch.
Built once per machine as a torch C++ extension into InferScale's cache (``cppext``).

The same source screens the LM head in int8 for greedy steps (``screen_ops``: ``vpdpbusd``, exact int32 sums; the
method and its bounds are ``greedy_screen.h``'s, shared with the AMX kernel; used by ``models/greedyhead.py``).

``load()`` returns None, and the model keeps oneDNN, on a CPU without AVX512-BF16 and AVX512-VNNI, where the build
fails, or with ``INFERSCALE_BF16_LINEAR=0``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from inferscale.cpuflags import cpu_flags
from inferscale.kernels import cppext

SOURCE = Path(__file__).with_name("bf16_linear.cpp")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-fopenmp"]
CHAINS = (512, 1024, 256, 2048)  # chain lengths tried, most common first
CHECK_ROWS = (2, 3, 17, 32)  # row counts a chain length for "more than one row" is checked at
# The most rows a pass hands this kernel (``decode_linear.max_rows``): the scheduler's prompt chunk. Past oneDNN's 32
# it still wins there: the 2-core Zen 4 machine, 2026-12-04, a Gemma-3-270M pass's 72 layer products (fused shapes),
# medians of 7 interleaved, 48 rows 12.7 vs 16.9 ms, 64 rows 15.8 vs 20.4, 96 rows 23.5 vs 27.3, 128 rows 29.1 vs
# 32.8, 256 rows 54.1 vs 58.3.
MAX_ROWS = 128


def build_dir() -> Path:
    return cppext.build_dir(SOURCE, FLAGS)


@functools.cache
def load() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``product(weight, x)``, the kernel built on first use (later processes load the cached build); None where it
    cannot run here."""
    runs_here = {"avx512_bf16", "avx512_vnni"} <= cpu_flags()
    return product if cppext.built(SOURCE, FLAGS if runs_here else None, "INFERSCALE_BF16_LINEAR") else None


def screen_ops() -> tuple[Callable, Callable] | None:
    """``(screen_pack, greedy_screen)`` on AVX512-VNNI (``bf16_linear.cpp``; the method is ``greedy_screen.h``'s, as
    on AMX): ``screen_pack(weight)`` -> [packed head (int8 + 128), stats], ``greedy_screen(*packed, x)``; None
    where the kernel is not built here."""
    if load() is None:
        return None
    return torch.ops.inferscale_bf16.screen_pack, torch.ops.inferscale_bf16.greedy_screen


def screen_rows() -> int:
    """Rows of x one ``greedy_screen`` call takes: up to 4 with two int8 rows each and an L1 bound, up to 16 with one
    int8 row each and a Cauchy-Schwarz bound (``bf16_linear.cpp``'s wide screen: at 16 rows two int8 rows a row
    cost as many products as the bf16 head; one costs half)."""
    return int(torch.ops.inferscale_bf16.greedy_screen_rows()) if load() is not None else 0


def rows_argmax() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``rows_argmax(logits)`` -> int64 [rows]: each row of contiguous bf16 ``logits`` [rows, n] reduced to its
    first maximum (its first NaN where it has one), as ``max(dim=-1).indices``, vectorized (16 rows x 262k logits:
    0.3 vs 3.7 ms); None where the kernel is not built here."""
    if load() is None:
        return None
    return torch.ops.inferscale_bf16.rows_argmax


def rescore(weight: torch.Tensor, x: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """bf16 [n]: for each (row of x, row of ``weight``) of ``candidates`` [n, 2] (int64, a row's together), that
    element of ``product(weight, x)``, bit for bit (the same chain), read from ``weight`` as it
    is: no gathered or packed copy (``bf16_linear.cpp``'s ``bf16_rescore``; the LM head's screened candidates)."""
    return torch.ops.inferscale_bf16.bf16_rescore(weight, x, candidates, chain(weight.shape[1]))


def product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` [rows, out] (bf16, contiguous) for a bf16 ``weight`` [out, in] and ``x`` [rows, in]."""
    return torch.ops.inferscale_bf16.bf16_linear(packed(weight), x, chain(weight.shape[1]), weight.shape[0])


def packed(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in the kernel's layout (``bf16_pack``: vectors of 16 outputs, pair by pair), kept on the tensor
    (``cppext.kept_packing``)."""
    return cppext.kept_packing(weight, "inferscale_bf16_packed", torch.ops.inferscale_bf16.bf16_pack)


@functools.cache
def chain(in_features: int) -> int:
    """oneDNN's chain length for ``in_features`` here with more than one row: the first of ``CHAINS`` (and the whole
    row) whose outputs equal F.linear's on a random weight at ``CHECK_ROWS`` rows; 512 where none does (weightmajor's
    check on the real weight then keeps oneDNN)."""
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(256, in_features, generator=gen).to(torch.bfloat16)
    xs = [torch.randn(rows, in_features, generator=gen).to(torch.bfloat16) for rows in CHECK_ROWS]
    packed_weight = torch.ops.inferscale_bf16.bf16_pack(weight)
    candidates = [c for c in (*CHAINS, in_features) if c <= in_features]
    with torch.inference_mode():
        refs = [torch.nn.functional.linear(x, weight) for x in xs]
        return next((c for c in candidates if all(
            torch.equal(torch.ops.inferscale_bf16.bf16_linear(packed_weight, x, c, weight.shape[0]), ref)
            for x, ref in zip(xs, refs))), CHAINS[0])


if __name__ == "__main__":  # scripts/setup.sh builds it ahead of the first model load
    logging.basicConfig(level=logging.INFO)
    print("bf16_linear:", "built" if load() is not None else "not available here (oneDNN is used)", build_dir())
