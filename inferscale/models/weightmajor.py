"""Linear layers as ``weight @ x.T`` where that gives the same numbers faster: decode's few rows (issue 22).

``F.linear(x, W)`` on a bf16 CPU model runs oneDNN's AMX matmul with ``W`` [out, in] as the *weights* operand,
which oneDNN repacks into its blocked layout on every call: per decode step that is every weight byte read and
written again (Gemma-3-270M: the 335 MB tied LM head and 200 MB of layers). ``torch.mm(W, x.T)`` (``torch.mv`` for
one row) runs the same oneDNN primitive (``brg_matmul:avx10_1_512_amx``, see ONEDNN_VERBOSE) with the roles
swapped: ``W`` is the source, read in place, and only the few activation rows are packed. Measured on the 2-core
AMX machine, one thread, CPU time (min of 9): LM head 26-28 ms vs 44-50 ms, the 126 layer projections 23 ms vs
35-38 ms, against 26 ms / 17 ms for a float32 read of the same bytes; batch 1 and 16 alike.

Each output is the same in-features-long dot product accumulated in the same order, so the results are bit for
bit ``F.linear``'s (0 of 29 M LM-head logits differed, 1 to 32 rows; at 33 rows and more F.linear changes kernel
and differs from its own one-row results, so those stay on F.linear). Only up to ``MAX_ROWS`` rows (decode
batches, short prompt chunks) take this path; longer inputs (prefill, encoding) are compute-bound and keep
``F.linear``. The swap is made only after that equality is checked on the loaded weights' shapes at load time
(``CHECK_ROWS``); on any other backend, dtype or device the model keeps its ``nn.Linear`` modules.

Where the CPU has AMX, the product is our own kernel (``kernels/amx_linear.cpp``): oneDNN's arithmetic for these
shapes (the same tile instruction, the same order, so again bit for bit F.linear's, checked the same way), with
the weight's rows split over every torch thread and prefetched. oneDNN reads a layer's weights on one thread at
~10-12 GB/s; the kernel reads them at ~20 GB/s, the machine's reduction bandwidth (issue 22: the 72 layer
products of a Gemma-3-270M decode step 10 ms instead of 17-22 ms; 16 rows 14 instead of 21 ms). With it, inputs of
up to ``decode_linear.max_rows()`` rows take the path; past F.linear's 32 each row gets what it gets among fewer rows.
On a CPU with AVX512-BF16 but no AMX (AMD Zen 4) the kernel is ``kernels/bf16_linear.cpp`` (``decode_linear`` picks):
oneDNN's ``vdpbf16ps`` arithmetic there, checked the same way (Gemma-3-270M's decode step on the 2-core Zen 4
machine 67 -> 25-29 ms through the server, the LM head 30-35 -> 10 ms).
"""

from __future__ import annotations

import logging

import torch

from inferscale.kernels import decode_linear

log = logging.getLogger(__name__)
# Up to 32 rows F.linear itself gives each row of a batch the same numbers (above, oneDNN picks another kernel and
# the numbers change): that is the range checked equal and swapped. A lone row got them too on AMX (the LM head,
# above), not on AVX512-BF16 at 2048 in-features (``in_a_batch``): the swapped product gives it a batch row's numbers.
MAX_ROWS = 32
CHECK_ROWS = (1, 3, 17, MAX_ROWS)  # row counts the equality is checked at, per weight shape
# Only a weight this large is read in row blocks, one per thread: the LM head (335 MB) streams from memory, where
# one core reads at ~13 GB/s; a layer's weights (at most 5 MB here) come from the cache (300 MB of L3) and their
# blocks' thread hand-offs cost more than they save (a decode step 54 vs 46 ms, 16 rows 84 vs 76 ms, interleaved).
SPLIT_MIN_BYTES = 64 * 2**20
KERNEL = -1  # the ``blocks`` value that runs the AMX kernel (every thread, any weight size)
# The kernels give each row what they give that row alone at any row count, and are faster than F.linear up to
# ``decode_linear.max_rows()`` rows (AMX: 64, amx_linear.cpp's numbers; AVX512-BF16: 128, the scheduler's prompt
# chunk, bf16_linear.py's); so with them, prompt chunks past F.linear's 32 take this path too (on AMX a 48-token pass
# of Gemma-3-270M 87 vs 100 ms, two 31-token questions 92 vs 116 ms), their rows bit for bit what the rows get alone.
ALONE_CHECK_ROWS = 128  # the rows of the call ``_rows_alone`` checks (at most the kernel's own limit)


def max_rows(blocks: int) -> int:
    """The most rows ``weight_major_product`` takes with ``blocks``; longer inputs keep F.linear. The kernel's own
    limit with it (``decode_linear.max_rows``: every count on AVX2, where aten's bf16 product is slower at all)."""
    return decode_linear.max_rows() if blocks == KERNEL else MAX_ROWS


def weight_major_product(weight: torch.Tensor, flat: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    """``flat @ weight.T`` for up to ``max_rows(blocks)`` rows of ``flat`` [rows, in], computed with ``weight``
    [out, in] as the operand read in place; returns [rows, out] (a transposed view; contiguous from the AMX kernel).

    oneDNN runs one such product on ONE thread (the few activation columns give it nothing to split), so with
    ``blocks`` > 1 ``weight``'s rows are cut into that many blocks run as one ``torch.bmm``, which gives each torch
    thread its own blocks: every core reads weights (worth it for a weight read from memory: SPLIT_MIN_BYTES).
    Measured on the 2-core AMX machine, LM head [262144, 640], batch 1: ``mv`` 24 ms = 13-14 GB/s at one and at
    two threads; 2 blocks 15 ms = 22 GB/s, the float32 read bandwidth of the machine. ``checked_blocks`` says which
    count gives F.linear's numbers; ``KERNEL`` runs ``decode_linear``'s kernel instead."""
    if blocks == KERNEL:
        return decode_linear.load()(weight, flat.contiguous())  # [rows, out], contiguous
    if blocks > 1:
        out_rows = weight.shape[0]
        parts = torch.bmm(weight.view(blocks, out_rows // blocks, weight.shape[1]),
                          flat.t().expand(blocks, -1, -1))  # [blocks, out / blocks, rows]
        return parts.reshape(out_rows, -1).t()
    if flat.shape[0] == 1:  # oneDNN's matmul with a [in, 1] operand is slower than mv here
        return torch.mv(weight, flat[0])[None]
    return torch.mm(weight, flat.t()).t()


def checked_blocks(weight: torch.Tensor, bias: torch.Tensor | None = None) -> int:
    """The ``blocks`` for ``weight_major_product`` that gives ``F.linear``'s numbers here on ``CHECK_ROWS`` rows (one
    row: what F.linear gives it in a batch, ``in_a_batch``):
    the AMX kernel (``KERNEL``) where it is built and equal, else one block per torch thread where that is equal
    (it is not for every shape: some block shapes take another oneDNN kernel), else 1 where the plain product is,
    else 0. Fixed at load, so a later thread count changes the speed, never the numbers."""
    threads = torch.get_num_threads()
    big = weight.numel() * weight.element_size() >= SPLIT_MIN_BYTES
    candidates = [threads, 1] if big and threads > 1 and weight.shape[0] % threads == 0 and weight.is_contiguous() \
        else [1]
    if decode_linear.fits(weight) and decode_linear.load() is not None:
        candidates.insert(0, KERNEL)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        xs = [torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype) for rows in CHECK_ROWS]
        refs = [in_a_batch(x, weight, bias) for x in xs]
        for blocks in candidates:
            outs = [weight_major_product(weight, x, blocks) for x in xs]
            if bias is not None:
                outs = [out + bias for out in outs]
            if all(torch.equal(out, ref) for out, ref in zip(outs, refs)) and (
                    blocks != KERNEL or _rows_alone(weight, xs[-1])):
                return blocks
    return 0


def in_a_batch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``'s numbers for ``x``'s rows as rows of a batch: a single row is computed beside a copy of itself,
    since oneDNN sums a lone row in other chains than a batch's row (AVX512-BF16, 2048 in-features: 512 against
    1024), which would make a request's decode depend on whether another decodes beside it."""
    if len(x) > 1:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.nn.functional.linear(torch.cat([x, x]), weight, bias)[:1]


def _rows_alone(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Past F.linear's range the kernel must give each row what it gives that row among fewer: ``x``'s rows
    first in a call of as many rows as a pass hands the kernel (``ALONE_CHECK_ROWS`` at most)."""
    rows = min(max_rows(KERNEL), ALONE_CHECK_ROWS)
    wide = torch.cat([x, x.flip(0)] * (rows // (2 * len(x)) + 1))[:rows]
    return torch.equal(weight_major_product(weight, wide, KERNEL)[: len(x)], weight_major_product(weight, x, KERNEL))


class WeightMajorLinear(torch.nn.Module):
    """``nn.Linear``'s result computed as ``(W @ x.T).T`` for up to ``max_rows(blocks)`` rows; shares the original's
    parameters (ties stay tied, the state dict keeps its names)."""

    def __init__(self, linear: torch.nn.Linear, blocks: int = 1, transposed_out: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.blocks = blocks  # checked_blocks(weight, bias)
        self.max_rows = max_rows(blocks)
        # The output as the product leaves it, a transposed view (the LM head: logits are only reduced and
        # converted, which read any layout alike). Making 16 rows of 262k logits contiguous took 7 ms a step.
        self.transposed_out = transposed_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > self.max_rows:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        out = weight_major_product(self.weight, flat, self.blocks)
        if not self.transposed_out:
            out = out.contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def install_weight_major_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of a bf16 CPU ``model`` by a ``WeightMajorLinear``, once the two are checked to
    give identical outputs here; returns how many were replaced (0: none, the model is unchanged)."""
    linears = [(name, mod) for name, mod in model.named_modules() if type(mod) is torch.nn.Linear]
    if not linears or any(m.weight.device.type != "cpu" or m.weight.dtype != torch.bfloat16 for _, m in linears):
        return 0
    checked: dict[tuple[int, int, bool], int] = {}
    for _, mod in linears:
        key = (mod.out_features, mod.in_features, mod.bias is not None)
        if key not in checked:
            checked[key] = checked_blocks(mod.weight.detach(), None if mod.bias is None else mod.bias.detach())
    if not all(checked.values()):
        log.info("weight @ x.T differs from F.linear on this machine; keeping nn.Linear")
        return 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, mod in linears:
        parent, _, attr = name.rpartition(".")
        blocks = checked[(mod.out_features, mod.in_features, mod.bias is not None)]
        setattr(model.get_submodule(parent) if parent else model, attr, WeightMajorLinear(mod, blocks, mod is head))
        if blocks == KERNEL:
            decode_linear.prepare(mod.weight)
    return len(linears)
