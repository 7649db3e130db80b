"""The serving loop's steps, counted and timed by the rows they decode (issue 22).

A client's time per output token is the engine's step plus whatever comes between: its own CPU, the event loop's,
the network. The tally is the engine's side alone, wall time of whole steps (a growth of the slot pool and the
questions run between a pass's layers included: every decoding row waited them out), read where it is wanted:
``/metrics`` (``inferscale_engine_steps_total`` and ``inferscale_engine_step_time_seconds_total`` by rows and
kind; their ratio over a window is the mean step, which a platform team watches against the batch it ran, as
vLLM's ``vllm:iteration_tokens_total`` counts a step's tokens) and ``bench load``, which prints the engine's own
N-row step inside the server beside the client's time per token.

Written by the loop's thread only; read from any thread as a snapshot (one dict copy, atomic under the GIL, of
immutable totals).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

StepKind = Literal["decode", "mixed", "prompt"]  # rows decoded alone, rows decoded and prompt tokens, prompts alone
StepKey = tuple[int, StepKind]  # (rows decoded, kind)
# Upper bounds of the rows label on /metrics ("1", "2", "3-4", "5-8", ..., then "257+"): a bounded set of label
# values whatever the batch, fine enough to tell one stream from a full batch.
ROW_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class StepTotals:
    steps: int = 0
    seconds: float = 0.0

    def __add__(self, other: StepTotals) -> StepTotals:
        return StepTotals(self.steps + other.steps, self.seconds + other.seconds)

    def __sub__(self, other: StepTotals) -> StepTotals:
        return StepTotals(self.steps - other.steps, self.seconds - other.seconds)

    @property
    def mean_s(self) -> float | None:
        return self.seconds / self.steps if self.steps else None


class StepTally:
    """Steps and their seconds by (rows decoded, kind), since the loop started."""

    def __init__(self) -> None:
        self._totals: dict[StepKey, StepTotals] = {}

    def add(self, rows: int, prompt_tokens: int, seconds: float) -> None:
        """One step that decoded ``rows`` rows and computed ``prompt_tokens`` prompt tokens in ``seconds``; a step
        that computed neither (only cancellations or refusals) is not counted."""
        if rows < 0 or prompt_tokens < 0:
            raise ValueError(f"rows {rows} and prompt tokens {prompt_tokens} must not be negative")
        if not rows and not prompt_tokens:
            return
        key: StepKey = (rows, "prompt" if not rows else "mixed" if prompt_tokens else "decode")
        self._totals[key] = self._totals.get(key, StepTotals()) + StepTotals(1, seconds)

    def snapshot(self) -> dict[StepKey, StepTotals]:
        return dict(self._totals)


def rows_label(rows: int) -> str:
    """The /metrics label of a step that decoded ``rows`` rows: its ``ROW_BOUNDS`` bucket ("0": prompts alone)."""
    if rows == 0:
        return "0"
    low = 0
    for bound in ROW_BOUNDS:
        if rows <= bound:
            return str(bound) if low + 1 == bound else f"{low + 1}-{bound}"
        low = bound
    return f"{low + 1}+"


def by_label(totals: Mapping[StepKey, StepTotals]) -> dict[tuple[str, StepKind], StepTotals]:
    """``totals`` summed into /metrics' (rows label, kind) series."""
    out: dict[tuple[str, StepKind], StepTotals] = {}
    for (rows, kind), t in totals.items():
        key = (rows_label(rows), kind)
        out[key] = out.get(key, StepTotals()) + t
    return out


def since(after: Mapping[StepKey, StepTotals], before: Mapping[StepKey, StepTotals]) -> dict[StepKey, StepTotals]:
    """The steps between two snapshots."""
    return {k: d for k, t in after.items() if (d := t - before.get(k, StepTotals())).steps > 0}
