"""``row_attention(q, k, v, mask, scale)``: attention of a few new tokens per row (a decode step's one, a kv
question's few dozen), each over the keys its own mask row shows (``row_attention.cpp``), on AVX512-BF16 CPUs, and
in an 8-lane float32 build of the same source on AVX2 CPUs without it (AMD Zen 3: ``flags``).

torch's CPU flash attention ran a 16-row decode step's attention of Gemma-3-270M (18 layers, 630 keys a row) in
~16-20 ms; this kernel reads only the keys each row's mask shows: ~6 ms where the K/V sit in L3 (one layer's cache
read 18 times), 10-12 ms where each layer reads its own from DRAM as a real step does (159 MB; 14-16 ms before it
prefetched the next task's K/V), and its result for a row does not depend on the other rows of the batch (torch's
did: it reduces each row over the batch's longest row, padded and masked, in an order that depends on that
length).
In a decode step each task prefetches the next task's K/V a few lines at a time through its products (before, all
at once while it rearranged its own keys, and memory sat idle through the products): on the 2-core Zen 4 machine,
2026-12-04, 16 rows x 640 keys, each of 18 layers its own K/V from DRAM, medians of 11 interleaved with the old
kernel, 401-484 -> 366-433 us a layer (0.89-0.93x), 1,500 keys 0.81-0.91x; where the K/V sit in L3 16 rows take
1.10-1.26x and one row 14-15 -> 15-17 us a layer, a kv question's pass (38 tokens) keeps the old prefetch and its
time. Same bits either way.

Since 2026-12-06 the keys are read in place, as the AVX2 build always did (each chunk's keys had been transposed
into one vector per pair of dims first, which for a decode step's 4 queries cost about as much as their products):
on the 2-core Zen 4 machine, 16 rows x 700 keys x 18 layers, interleaved with the old kernel, 5.5-5.7 -> 4.1-4.5 ms
where the K/V sit in L3, 8.4-10.9 -> 6.9-8.7 ms where each layer reads its own from DRAM (the spread is the
machine's memory speed); a 1-row 40-token pass over the same keys 6.8-7.1 -> 7.8 ms (L3), the price of scoring every
pass one way, so that a token still gets the same bits in any pass. The tasks run on ``parallel_stealing`` (a
thread preempted by the server's event loop or a client no longer holds the others up at the layer's end).

How: per row and key head, the keys in chunks of 64 at absolute indices (a task each, over torch's threads); every query
of the row (its new tokens x the key head's query heads), 4 at a time, against 4 keys at a time read in place, each
score a vector of ``vdpbf16ps`` lane sums over the key's row added across lanes 16 keys at a time; the values paired key
by key (in registers for a decode step, once per chunk for a question's many queries) so that the p.V sums of 16 dims
are ``vdpbf16ps`` products; the chunks' (max, sum, p.V) combined in key order. Its outputs are not torch's bits (another
summation order; p rounded to bf16 per chunk of keys, not per block of 512). ``load()`` hands the operator out only
after checking, on random shapes of the layouts Gemma uses, that (1) its error against a float64 reference is no larger
than SDPA's own (``ERROR_RATIO``), and (2) every row's output is the same alone and in a batch with longer, masked rows.
None, and attention stays SDPA, on CPUs without AVX2, where the build fails, where a check fails, or with
``INFERSCALE_ROW_ATTENTION=0``. What it does to answers is measured end to end (docs/bench/HISTORY.md, "attention row by
row": answers against the SDPA path over LoCoMo questions).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from inferscale.cpuflags import cpu_flags
from inferscale.kernels import cppext

SOURCE = Path(__file__).with_name("row_attention.cpp")
AVX512_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"]
AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # the source's 8-lane float32 path (no AVX512-BF16)
# new tokens per row it takes (decode, a kv question, a prompt chunk: the scheduler's are at most 128; the C++ checks
# the same), and new tokens x query heads per key head; longer passes: SDPA. On the 2-core Zen 4 machine, 2026-12-04,
# a 1-row pass of Gemma-3-270M's 18 layers over ~470 memory keys, medians of 9 interleaved with SDPA: 40 tokens 3.5
# vs 12.0 ms, 64 tokens 6.3 vs 17.3, 96 tokens 9.3 vs 27.1, 128 tokens 12.0 vs 36.8 (64 was the limit until then:
# a 66-token kv question's pass took 59 ms against a 61-token one's 33).
MAX_TOKENS = 128
MAX_QUERIES = 512  # new tokens x query heads per key head (the C++'s kMaxQueries)
MAX_GROUP = 8  # query heads per key head it takes (the C++'s kMaxGroup)
HEAD_MULTIPLE = 64  # head sizes it takes: multiples of this up to 512
ERROR_RATIO = 1.25  # its mean and max error against float64 may exceed SDPA's by at most this factor
# (batch, query heads, key heads, new tokens, keys, head size): Gemma-3-270M's decode and question shapes, a wider
# group, a single key, a long row, a whole prompt chunk
CHECK_SHAPES = ((4, 4, 1, 1, 630, 256), (2, 4, 1, 9, 300, 256), (3, 8, 2, 1, 77, 128), (2, 4, 1, 1, 1, 256),
                (2, 4, 1, 1, 1500, 256), (1, 4, 1, 128, 600, 256))

RowAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]


def flags() -> list[str] | None:
    """The build for this CPU: AVX512-BF16's ``vdpbf16ps`` path, else the AVX2 one, else none (SDPA stays)."""
    if "avx512_bf16" in cpu_flags():
        return AVX512_FLAGS
    return AVX2_FLAGS if {"avx2", "fma"} <= cpu_flags() else None


def build_dir() -> Path:
    return cppext.build_dir(SOURCE, flags() or AVX2_FLAGS)


@functools.cache
def load() -> RowAttention | None:
    """The operator once built and checked here; None where attention stays SDPA."""
    if not cppext.built(SOURCE, flags(), "INFERSCALE_ROW_ATTENTION"):
        return None
    return cppext.checked(torch.ops.inferscale_attention.row_attention, agrees,
                          "row_attention's error exceeds SDPA's here; attention stays SDPA")


def fits(tokens: int, group: int) -> bool:
    """Whether a pass of ``tokens`` new tokens a row, ``group`` query heads per key head, is the kernel's to take."""
    return tokens <= MAX_TOKENS and tokens * group <= MAX_QUERIES


def takes(dtype: torch.dtype, device: torch.device, head_dim: int, group: int) -> bool:
    """Whether a model of this dtype, device, head size and query heads per key head can attend through the kernel."""
    return (dtype == torch.bfloat16 and device.type == "cpu" and head_dim % HEAD_MULTIPLE == 0 and head_dim <= 512
            and group <= MAX_GROUP)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """What the kernel computes, through SDPA: q [B, H, T, D] over k, v [B, H_kv, K, D] -> [B, T, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


def padded_mask(lengths: list[int], tokens: int, keys: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, tokens, keys]: row b's new tokens are its last ``tokens`` of lengths[b]; each sees the keys up to
    itself (its last ``window`` of them where one is given), as SlotCache.mask hands a pass over such rows."""
    last = torch.tensor(lengths)[:, None] - tokens + torch.arange(tokens)[None]  # [B, T]: each new token's position
    diff = last[:, :, None] - torch.arange(keys)[None, None]
    shown = diff >= 0
    if window is not None:
        shown &= diff < window
    return torch.zeros(len(lengths), 1, tokens, keys, dtype=dtype).masked_fill_(~shown[:, None], torch.finfo(dtype).min)


def errors(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """|got - exact| and |SDPA - exact| elementwise, exact the float64 reference, and exact itself."""
    exact = reference(q.double(), k.double(), v.double(), None if mask is None else mask.double(), scale)
    return (got.double() - exact).abs(), (reference(q, k, v, mask, scale).double() - exact).abs(), exact


def agrees(op: RowAttention) -> bool:
    """The kernel against SDPA and float64 on CHECK_SHAPES (no mask, rows of other lengths, a sliding window), and
    each row's output alone against the same row in the batch."""
    gen = torch.Generator().manual_seed(0)
    for batch, heads, kv_heads, tokens, keys, dim in CHECK_SHAPES:
        scale = dim ** -0.5
        q = torch.randn(batch, heads, tokens, dim, generator=gen).to(torch.bfloat16)
        k = torch.randn(batch, kv_heads, keys, dim, generator=gen).to(torch.bfloat16)
        v = torch.randn(batch, kv_heads, keys, dim, generator=gen).to(torch.bfloat16)
        lengths = [max(tokens, keys - 37 * b) for b in range(batch)]
        for mask in (None, padded_mask(lengths, tokens, keys, None, torch.bfloat16),
                     padded_mask(lengths, tokens, keys, max(1, keys // 3), torch.bfloat16)):
            got = op(q, k, v, mask, scale)
            err, sdpa_err, exact = errors(got, q, k, v, mask, scale)
            ulp = exact.abs().max().item() * 2.0 ** -8  # one bf16 place of the largest output: room at tiny errors
            if (err.mean() > ERROR_RATIO * sdpa_err.mean() + ulp / 64 or err.max() > ERROR_RATIO * sdpa_err.max() + ulp
                    or not torch.isfinite(got.float()).all()):
                return False
            if mask is not None and not all(
                    torch.equal(op(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], mask[b:b + 1, ..., :n], scale),
                                got[b:b + 1]) for b, n in enumerate(lengths)):
                return False
    return True


if __name__ == "__main__":  # scripts/setup.sh builds it ahead of the first model load
    print("row_attention:", "built" if load() is not None else "not available here (SDPA is used)", build_dir())
