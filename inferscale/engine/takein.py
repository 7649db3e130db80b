"""How long a burst's arrivals are believed to slow the passes beside them (``Scheduler.taking_in``, issue 22).

While requests are taken in (announced by ``expect``, not yet added) their HTTP, tokenizing and retrieval run on the
same cores as the engine's passes. Measured on the 2-core CPU in a burst of 32 ~2,300-token text requests
(``bench load --flood --flood-words 1500``): the engine thread ran 0.43-0.70 of its first passes' wall time and a
prompt token cost 1.3-1.9 ms, against 0.5-0.65 once they were in, ~1.1 s later; learnt, that transient shed kept
requests ~1 s after they arrived, which the steady cost would have served. The cost estimates learn nothing
upward meanwhile (``stepcost.learn``), for at most TAKE_IN_S in a row, earned back by as long a time with nothing
arriving: arrivals that never stop are load, not a transient, and cannot hold the estimates down more than half
the time. No lock of its own: the scheduler calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from inferscale.engine.scheduled import ScheduledRequest

TAKE_IN_S = 1.5


class TakeIn:
    """The allowance: TAKE_IN_S, spent while requests arrive, earned back while none do."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._left, self._at = TAKE_IN_S, clock()

    def spend(self, arriving: bool) -> bool:
        """Charge (``arriving``: requests were on their way since the last call) or earn back the time since the
        last call; call before what arrives changes. True while requests arrive and the allowance lasts."""
        now = self._clock()
        spent, self._at = now - self._at, now
        self._left = min(max(self._left - spent if arriving else self._left + spent, 0.0), TAKE_IN_S)
        return arriving and self._left > 0


class Announced(Protocol):
    def arrived(self, req: ScheduledRequest) -> None: ...


class Arrival:
    """A request announced to the scheduler before it is added (``Scheduler.expect``); ``close`` is idempotent."""

    def __init__(self, scheduler: Announced | None, req: ScheduledRequest | None = None) -> None:
        self._scheduler, self.req = scheduler, req  # None: a backend whose own scheduler queues (no-op)

    def close(self) -> None:
        if self._scheduler is not None and self.req is not None:
            self._scheduler.arrived(self.req)
            self._scheduler = None
