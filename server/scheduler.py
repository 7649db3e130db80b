"""The asyncio side of the engine worker (``inferscale.engine.worker``): a request's events, produced on the worker
thread, arrive on the request's event loop in order."""

from __future__ import annotations

import asyncio
import collections
import weakref

from inferscale.engine.loop import Event, GenRequest
from inferscale.engine.worker import EngineWorker

__all__ = ["EngineWorker", "EventStream"]


class _Mailbox:
    """One event loop's events from the worker thread, handed over in batches: a decode step of 16 streams emits 16
    events at once, and each ``call_soon_threadsafe`` takes a lock and writes the loop's wake-up pipe (~5-10 us on the
    worker thread, whose step every stream waits for) and runs as a callback of its own on the loop. Here the first
    event of a burst schedules one drain and the rest join it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._events: collections.deque[tuple[asyncio.Queue[Event], Event]] = collections.deque()
        self._scheduled = False

    def post(self, queue: asyncio.Queue[Event], event: Event) -> None:  # worker thread
        if self.loop.is_closed():
            raise RuntimeError("the request's event loop is closed")
        # Appended before the flag is read, and the drain clears the flag before it reads: an event is always
        # drained by a drain scheduled after it was appended or by one already running (at worst a drain finds none).
        self._events.append((queue, event))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # the loop's thread
        self._scheduled = False
        while self._events:
            queue, event = self._events.popleft()
            queue.put_nowait(event)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    """The loop's mailbox (made on the loop's thread, when a request's stream is)."""
    box = _mailboxes.get(loop)
    if box is None:
        box = _mailboxes[loop] = _Mailbox(loop)
    return box


class EventStream:
    """Hands a request's events from the worker thread to its asyncio loop; ``bind`` a GenRequest to it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.request: GenRequest | None = None
        self._mailbox = _mailbox(asyncio.get_running_loop())

    def emit(self, event: Event) -> None:  # worker thread
        try:
            self._mailbox.post(self.queue, event)
        except RuntimeError:  # the request's loop is gone: stop generating for it
            if self.request is not None:
                self.request.cancel()

    async def next(self) -> Event:
        return await self.queue.get()

    def cancel(self) -> None:
        if self.request is not None:
            self.request.cancel()
