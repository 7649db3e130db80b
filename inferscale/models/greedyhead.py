"""A greedy decode step's token without reading the bf16 LM head: an int8 screen, then the few rows it leaves.

The LM head of Gemma-3-270M is 335 MB of bf16, 62 % of the bytes a decode step reads (issue 22), yet a greedy
step needs only the argmax of its logits. ``GreedyHead`` keeps an int8 copy of the head (half the bytes, one scale
a row) and per-row error bounds; the decode kernel's ``greedy_screen`` (``kernels/greedy_screen.h``: AMX
``tdpbssd`` in ``amx_linear.cpp``, AVX512-VNNI ``vpdpbusd`` in ``bf16_linear.cpp``, AVX2 ``vpmaddwd`` with x as one
int16 row in ``avx2_linear.cpp``) reads the int8 copy once, bounds
every logit, and returns the few vocabulary rows whose bound reaches the best (median 2, p99 ~100 of 262,144 on
LoCoMo text); those rows are then computed exactly, the full head's bits (on the AVX512-BF16 kernel each
candidate's logit alone straight from the bf16 head, ``decode_linear.rescorer``; elsewhere their rows gathered and
multiplied by the same kernel as the full head) and the first maximum is taken. The bounds are rigorous
(quantization error of the weights and of the activations, float32 summation, and a margin of two bf16 steps so
that a row left out cannot even tie), so the token is the full head's argmax bit for bit; the screen checks that at
install time too. Rows that need logits (sampling, the first logits kept for
fidelity, an argmax that is a stop token ``min_tokens`` bans: ``engine/tokenchoice.py``) take the full head
(``Head.logits``).

Used only where the head's logits come from the decode kernel (``decode_linear``: so the rescored rows are those
logits bit for bit) and it has a screen (AMX-INT8, AVX512-VNNI beside AVX512-BF16, or AVX2), there is no final
soft-capping or bias. One screen call takes up to ``decode_linear.screen_rows()`` rows; more are screened in calls
of that many and the rest where that costs less than the full head (``decode_linear.screen_groups``: the VNNI and
AVX2 kernels; a 32-row decode step 44.4 -> 37.8 ms on Zen 4), else they read the full head. On AMX 4 (its tiles,
two int8 rows of x each: 1 row 10 vs 19 ms, 4 rows 13 vs 20, 16 rows 30 vs 23). On the VNNI kernel 16: up to 4 rows
two int8 rows of x each, from 5 to 16 rows one (the wide screen, with a Cauchy-Schwarz bound: at 16 rows two int8
rows a row cost as many products as the bf16 head). Zen 4, 2026-12-03,
screen alone vs the full head on real Gemma hidden rows (medians of 10): 1 row 4.8 vs 8.3 ms, 4 rows 4.4 vs 8.8, 8
rows 5.3 vs 9.8, 16 rows 9.9 vs 16.2 (+ 0.6 ms rescoring a median of ~320 candidates a row, max ~1,100, at 16 rows;
the screen 9.4 ms once its sink read a vector's stats once, 8.6-8.8 once its threads shared their best lower
bounds, 2026-12-06).
Before the screen's accumulators were kept in registers and the head went in unsigned (x signed, broadcast), 4 rows
took 9.3 ms and 16 rows 20-22 ms. At one row the screen reads the 168 MB int8 head about as fast as a float32 sum
reads it (4.8 vs 3.6 ms at ~45 GB/s, 5.8 vs 5.4 at ~31). On the AVX2 kernel 16, x one int16 row each and the smaller
of the two bounds (``greedy_screen.h``'s ``quantize_fine``): 2-core Zen 3, 2026-12-03, real Gemma hidden rows,
screen alone vs the full bf16 head (medians of 7): 1 row 5.7 vs 12.3 ms (a float32 sum reads the int8 head in 5.2),
4 rows 6.6-10.6 vs 13.9-17.4, 8 rows 11.3 vs 23.4, 16 rows 22.2-23.3 vs 45.2-49.8; a median of 2 candidates a row
(p90 15, max 203).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inferscale.kernels import decode_linear
from inferscale.models.weightmajor import KERNEL

log = logging.getLogger(__name__)
MAX_CANDIDATES = 4096  # per row of x: past it (a flat distribution) the full head is cheaper than the rescoring
CHECK_ROWS = 16  # rows of each scale checked against the full head at install, in calls of CHECK_SIZES' rows
CHECK_SIZES = (1, 4, 8, 16)  # each of the kernels' paths: two int8 rows of x each (1-4), one (5-8 and 9-16)


class GreedyHead:
    """The LM head's int8 screen (``screen_pack``'s weight and bounds) beside the bf16 head it stands in for."""

    def __init__(self, weight: torch.Tensor) -> None:
        ops = decode_linear.screen_ops()
        assert ops is not None, "GreedyHead needs the decode kernel's screen (install_greedy_head checks)"
        pack, self._screen = ops
        self.weight = weight  # the bf16 head [vocab, in]: the candidates' rows are read from it
        self.packed: list[torch.Tensor] = pack(weight)  # the int8 head and its bounds, as the kernel reads them
        self.max_rows = decode_linear.screen_rows()  # the most rows one screen call takes
        self.grouped = decode_linear.screen_groups()  # more rows: in groups of at most max_rows, or the full head
        self._rescore = decode_linear.rescorer()  # None: the candidates' rows gathered and multiplied instead

    def argmax(self, hidden: torch.Tensor) -> list[int] | None:
        """The full head's argmax for each row of ``hidden`` [rows, in] (bf16), or None where the screen does not
        apply (more rows than one call takes where they are not grouped, a non-finite value, too many candidates): the
        caller computes the logits then."""
        rows = hidden.shape[0]
        if (rows > self.max_rows and not self.grouped) or not bool(torch.isfinite(hidden).all()):
            return None
        hidden = hidden.contiguous()
        candidates = self._candidates(hidden)  # [n, 2]: (row, vocabulary row), sorted
        if candidates.shape[0] > MAX_CANDIDATES * hidden.shape[0]:
            return None
        if self._rescore is not None:  # each candidate's logit alone, from the head as it is
            logits = self._rescore(self.weight, hidden, candidates).float()
            if not bool(torch.isnan(logits).any()):  # (a NaN: the product below, whose max takes the first NaN)
                return _first_max_by_row(candidates, logits, hidden.shape[0])
        exact = decode_linear.load()(self.weight.index_select(0, candidates[:, 1]), hidden)  # [rows, n]
        mine = candidates[:, 0][None, :] == torch.arange(hidden.shape[0])[:, None]
        first = exact.masked_fill(~mine, float("-inf")).max(dim=-1).indices  # the first maximum, as argmax takes
        return candidates[first, 1].tolist()

    def _candidates(self, hidden: torch.Tensor) -> torch.Tensor:
        """The screen's candidates for every row of ``hidden``: one call for up to ``max_rows`` rows, else calls of
        ``max_rows`` and one for the rest (a row's candidates depend on its own row alone), renumbered to its rows."""
        rows = hidden.shape[0]
        if rows <= self.max_rows:
            return self._screen(*self.packed, hidden)
        parts = []
        for start in range(0, rows, self.max_rows):
            end = min(rows, start + self.max_rows)
            part = self._screen(*self.packed, hidden[start:end])
            part[:, 0] += start
            parts.append(part)
        return torch.cat(parts)


def _first_max_by_row(candidates: torch.Tensor, logits: torch.Tensor, rows: int) -> list[int]:
    """Each row's vocabulary row of the first maximum of ``logits`` [n] among its own ``candidates`` [n, 2] (by row,
    then vocabulary order: the first maximum, as argmax takes it)."""
    row = candidates[:, 0]
    best = torch.full((rows,), float("-inf")).scatter_reduce(0, row, logits, "amax")
    hit = logits == best[row]
    at = torch.arange(len(logits))
    first = torch.full((rows,), len(logits), dtype=torch.long).scatter_reduce(0, row[hit], at[hit], "amin")
    return candidates[first, 1].tolist()


def install_greedy_head(head: torch.nn.Module, softcap: float | None) -> GreedyHead | None:
    """A ``GreedyHead`` for ``head`` (a ``WeightMajorLinear`` on the decode kernel) once its argmax is checked equal
    to the full head's on random rows; None where it cannot stand in (see the module's docstring)."""
    weight = getattr(head, "weight", None)
    if (softcap is not None or getattr(head, "bias", None) is not None or getattr(head, "blocks", None) != KERNEL
            or weight is None or not decode_linear.fits(weight) or weight.shape[1] % 64 or weight.shape[0] >= 2**24
            or decode_linear.screen_ops() is None):
        return None
    with torch.inference_mode():
        greedy = GreedyHead(weight.detach())
        gen = torch.Generator().manual_seed(0)
        for scale in (1.0, 10.0, 100.0):
            rows = (torch.randn(CHECK_ROWS, weight.shape[1], generator=gen) * scale).to(weight.dtype)
            full = head(rows).max(dim=-1).indices.tolist()
            calls = [(i, size) for size in CHECK_SIZES if size <= greedy.max_rows for i in range(0, CHECK_ROWS, size)]
            if any(greedy.argmax(rows[i:i + size]) not in (None, full[i:i + size]) for i, size in calls):
                log.warning("the LM head's int8 screen disagrees with the full head here; greedy steps read it all")
                return None
    return greedy


def first_max(logits: torch.Tensor) -> list[int]:
    """Each row's first maximum of ``logits`` [rows, vocab] (its first NaN where it has one), as
    ``max(dim=-1).indices`` gives it: through the decode kernel's vectorized reduction for bf16 rows on the CPU
    where it is built (aten reduces a bf16 row element by element: 16 rows of 262k logits 3.7 vs 0.3 ms), else
    aten's."""
    reduce = decode_linear.rows_argmax()
    if reduce is not None and logits.dim() == 2 and logits.dtype == torch.bfloat16 and logits.device.type == "cpu":
        return reduce(logits.contiguous()).tolist()
    return logits.max(dim=-1).indices.tolist()


@dataclass
class Head:
    """A pass's last hidden rows [rows, in] before the LM head: their logits, or only their argmax (cheaper where a
    ``GreedyHead`` stands in). ``computed`` set means the pass computed the logits already (the model's own
    forward), or ``logits()`` did."""

    hidden: torch.Tensor | None
    project: Callable[[torch.Tensor], torch.Tensor] | None = None  # hidden -> logits [rows, vocab]
    greedy: GreedyHead | None = None
    computed: torch.Tensor | None = field(default=None, repr=False)

    def logits(self) -> torch.Tensor:
        if self.computed is None:
            self.computed = self.project(self.hidden)
        return self.computed

    def argmax(self) -> list[int]:
        """Each row's greedy token: the first maximum of its logits (as ``max(dim).indices`` gives it); ``computed``
        stays None when the screen answered."""
        if self.computed is None and self.greedy is not None:
            tokens = self.greedy.argmax(self.hidden)
            if tokens is not None:
                return tokens
        return first_max(self.logits())
