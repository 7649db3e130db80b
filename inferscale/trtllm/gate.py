"""Tenants' parts of TensorRT-LLM's batch slots and K/V pool, with a queue per tenant in front of it.

TensorRT-LLM's scheduler admits first come, first served: a tenant whose requests filled its batch (``max_batch_size``)
or its K/V pool held up every other tenant's requests behind its own. So a request reaches TensorRT-LLM only within
its tenant's part of both (``engine/capacity.py``, the rule the PyTorch engine's scheduler admits by: a reserve held
back for tenants with nothing in flight, the rest split between those with requests in flight or queued). Past its
part it waits here, its tenant's requests in order; as requests end the oldest waiting head that fits goes next, of
whichever tenant. A request that waits longer than the queue timeout is refused (EngineBusyError, a 503 with
Retry-After), as the PyTorch engine's queue refuses one; one cancelled while it waits never reaches TensorRT-LLM.

Runs on the backend's driver loop only (``TrtllmBackend._drive``), so no lock: ``enter`` and ``leave`` are
never called from two threads.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from inferscale.engine.capacity import Capacity
from inferscale.engine.scheduled import ScheduledRequest, retry_after_s
from inferscale.errors import EngineBusyError

# How often a waiting request looks at its client's cancellation and its deadline (GenRequest.cancel sets a flag).
POLL_S = 0.1


class Cancelled(Exception):
    """The request was cancelled while it waited: it never reached TensorRT-LLM."""


class TenantGate:
    def __init__(self, capacity: Capacity, queue_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.queue_timeout_s, self.clock = capacity, queue_timeout_s, clock
        self._queues: dict[str, deque[ScheduledRequest]] = {}
        self._admitted: dict[int, asyncio.Event] = {}  # a waiting request's id -> set once it holds its place
        self.waiting = 0  # requests queued here (an int: other threads read it for the server's queue depth)

    async def enter(self, req: ScheduledRequest, cancelled: Callable[[], bool]) -> None:
        """Return once ``req`` holds its place within its tenant's part; EngineBusyError after the queue timeout,
        Cancelled once ``cancelled()``, neither holding anything."""
        if not self._queues.get(req.tenant) and self.capacity.fits(req, self._tenants(req.tenant)):
            self.capacity.take(req)
            return
        admitted = self._admitted[req.id] = asyncio.Event()
        self._queues.setdefault(req.tenant, deque()).append(req)
        self.waiting += 1
        deadline = req.arrived + self.queue_timeout_s
        try:
            while not admitted.is_set():
                if cancelled():
                    raise Cancelled()
                if self.clock() > deadline:
                    raise EngineBusyError(f"request waited over {self.queue_timeout_s:g} s for tenant "
                                          f"{req.tenant!r}'s part of the engine; retry later",
                                          retry_after_s=retry_after_s(self.queue_timeout_s))
                try:
                    await asyncio.wait_for(admitted.wait(), POLL_S)
                except TimeoutError:
                    pass
        except BaseException:
            if admitted.is_set():  # let in as it gave up: hand its place on
                self.leave(req)
            else:
                self._drop(req)
            raise
        finally:
            self._admitted.pop(req.id, None)

    def leave(self, req: ScheduledRequest) -> None:
        """``req`` ended (or never ran): its place goes to the waiting requests that now fit, oldest first."""
        self.capacity.give(req)
        while (head := self._next_that_fits()) is not None:
            self._unqueue(head)
            self.capacity.take(head)
            self._admitted[head.id].set()

    def _next_that_fits(self) -> ScheduledRequest | None:
        heads = sorted((q[0] for q in self._queues.values()), key=lambda r: r.arrived)
        return next((r for r in heads if self.capacity.fits(r, self._tenants(r.tenant))), None)

    def _tenants(self, tenant: str) -> int:
        """Tenants with requests in flight or queued, ``tenant`` included: how many share the parts."""
        return len({tenant, *self._queues, *self.capacity.tenants()})

    def _drop(self, req: ScheduledRequest) -> None:
        self._unqueue(req)
        self.leave(req)  # (it holds nothing) the requests behind it may fit now

    def _unqueue(self, req: ScheduledRequest) -> None:
        queue = self._queues.get(req.tenant)
        if queue is not None and req in queue:
            queue.remove(req)
            self.waiting -= 1
            if not queue:
                del self._queues[req.tenant]
