"""Another tenant's short prompt between two layers of a pass in progress (issue 22: fair under a flood).

A forward pass cannot be cut short, and on a 2-core CPU one of a flooding tenant's 64-token prompt passes takes
~40 ms: another tenant's question that arrived as it began waited all of it before its own pass ran (``bench load
--flood``: tenant B's first token 1.8-2.0x its idle TTFT; each of B's probes follows the last, so it arrives as one
of A's passes begins). While the serving loop runs a pass through the lean model, ``Interjector`` is its
``between_layers``: after each layer it asks the scheduler for a queued request of a tenant the pass does not compute
for and with no prompt started (``Scheduler.take_newcomer``), which the loop's ``fits`` accepts (a prompt of one
pass, a free slot, no growth of the slots), and has the loop run that prompt there, to its first token. The newcomer
waits one layer, not a pass; the paused pass then goes on from its next layer, its numbers unchanged: the newcomer's
slot comes after every row of the pass, nothing is reallocated, and the rows the loop would move when a prompt is done
(a decoding row joins the others) move once the pass is over (``ServingLoop._settle``). A tenant that interjected
in a pass goes again in it only where no other waiting tenant can (once a pass, a tenant's next question, sent as
its first was answered, waited out the rest of a 56-row decode pass: 105 ms against 36-45 for the others), and none
does once the pass has waited ``budget_s`` for them (a step's share for a newcomer, ``NEWCOMER_STEP_SHARE`` of
``step_time_s``: many questions do not hold one pass up for long; the rest go first in the next step); the time
spent on them stays out of the paused pass's measured cost
(``take_elapsed``). Measured on the 2-core Zen 4 machine, 2026-12-05 (docs/bench/HISTORY.md): B's first token under
the flood 1.86x [1.77, 1.99] its idle TTFT before, 1.17x [1.12, 1.58] after (3 repeats each); 1.97x vs 1.31x
interleaved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from inferscale.engine.scheduled import ScheduledRequest
from inferscale.engine.scheduler import Scheduler


class LayerPass(Protocol):
    """What the interjector sets: the lean model's hook, called after every layer but the last."""

    between_layers: Callable[[], None] | None


class Interjector:
    """The serving loop's hook between layers: ``fits`` and ``run`` are the loop's (which request may run inside
    a paused pass, and running it); ``budget_s`` the most a pass waits for them."""

    def __init__(self, scheduler: Scheduler, fits: Callable[[ScheduledRequest], bool],
                 run: Callable[[ScheduledRequest], None], budget_s: float) -> None:
        self.scheduler, self._fits, self._run, self.budget_s = scheduler, fits, run, budget_s
        self.nested = False  # a newcomer's prompt is running inside a paused pass
        self._busy: set[str] = set()  # the paused pass's tenants
        self._taken: set[str] = set()  # those that interjected in it
        self._elapsed = 0.0
        self._paused_s = 0.0  # how long the pass in progress has waited for interjected prompts

    @contextmanager
    def around(self, model: LayerPass | None, tenants: set[str]) -> Iterator[None]:
        """While a pass computing for ``tenants`` runs through ``model`` (None: a model without the hook, or a
        pass inside another: nothing interjects)."""
        if model is None or self.nested:
            yield
            return
        self._busy, self._taken, self._paused_s = set(tenants), set(), 0.0
        model.between_layers = self._between
        try:
            yield
        finally:
            model.between_layers = None

    def take_elapsed(self) -> float:
        """Seconds spent on interjected prompts since the last call (the pass that was paused did not take them)."""
        elapsed, self._elapsed = self._elapsed, 0.0
        return elapsed

    def _between(self) -> None:
        if self.nested or self._paused_s >= self.budget_s:
            return
        take = self.scheduler.take_newcomer
        req = take(self._busy | self._taken, self._fits) or (take(self._busy, self._fits) if self._taken else None)
        if req is None:
            return
        self._taken.add(req.tenant)
        t0 = time.perf_counter()
        self.nested = True
        try:
            self._run(req)
        finally:
            self.nested = False
            took = time.perf_counter() - t0
            self._elapsed += took
            self._paused_s += took
