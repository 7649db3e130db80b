"""The asyncio side of the engine worker (``inferscale.engine.worker``): a request's events, produced on the worker
thread, arrive on the request's event loop in order."""

from __future__ import annotations

import asyncio

from inferscale.engine.loop import Event, GenRequest
from inferscale.engine.worker import EngineWorker

__all__ = ["EngineWorker", "EventStream"]


class EventStream:
    """Hands a request's events from the worker thread to its asyncio loop; ``bind`` a GenRequest to it."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.request: GenRequest | None = None

    def emit(self, event: Event) -> None:  # worker thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the request's loop is gone: stop generating for it
            if self.request is not None:
                self.request.cancel()

    async def next(self) -> Event:
        return await self.queue.get()

    def cancel(self) -> None:
        if self.request is not None:
            self.request.cancel()
