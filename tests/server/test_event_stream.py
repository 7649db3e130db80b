"""EventStream: a request's events cross from the engine's worker thread to its asyncio loop in order, a burst of
them (a decode step's, one per stream) in one hand-over, and a request whose loop is gone is cancelled."""

from __future__ import annotations

import asyncio
import threading

import pytest
import uvloop

from inferscale.engine.loop import DoneEvent, TokenEvent
from inferscale.server.scheduler import EventStream


class _Request:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def _tokens(n: int, stream: int) -> list[TokenEvent]:
    return [TokenEvent(i, f"{stream}:{i}", float(i)) for i in range(n)]


@pytest.mark.parametrize("loop_factory", [None, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_each_request_gets_its_events_in_order_from_the_worker_thread(loop_factory):
    async def main() -> list[list[str]]:
        streams = [EventStream() for _ in range(16)]

        def worker() -> None:  # a decode step at a time: one token for each stream
            for i in range(50):
                for s, stream in enumerate(streams):
                    stream.emit(_tokens(50, s)[i])
            for stream in streams:
                stream.emit(DoneEvent("length", 1, 0, 50, 0.0))

        thread = threading.Thread(target=worker)
        thread.start()
        got: list[list[str]] = []
        for stream in streams:
            texts = []
            while not isinstance(ev := await asyncio.wait_for(stream.next(), 10), DoneEvent):
                texts.append(ev.text)
            got.append(texts)
        thread.join()
        return got

    with asyncio.Runner(loop_factory=loop_factory) as runner:  # `inferscale serve` runs on uvloop
        got = runner.run(main())
    assert got == [[f"{s}:{i}" for i in range(50)] for s in range(16)]


def test_a_burst_of_events_wakes_the_loop_once_not_once_an_event():
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        streams = [EventStream() for _ in range(16)]
        calls = 0
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        release = threading.Event()

        def worker() -> None:
            for s, stream in enumerate(streams):  # the loop is busy (below) while the step's events go out
                stream.emit(_tokens(1, s)[0])
            release.set()

        thread = threading.Thread(target=worker)
        thread.start()
        release.wait(10)  # blocks the loop: nothing is drained until every event is posted
        events = [await asyncio.wait_for(stream.next(), 10) for stream in streams]
        thread.join()
        return calls, len(events)

    calls, delivered = asyncio.run(main())
    assert delivered == 16
    assert calls == 1


def test_a_request_whose_loop_is_gone_is_cancelled():
    async def make() -> EventStream:
        return EventStream()

    loop = asyncio.new_event_loop()
    stream = loop.run_until_complete(make())
    request = _Request()
    stream.request = request  # type: ignore[assignment]
    loop.close()
    stream.emit(_tokens(1, 0)[0])
    assert request.cancelled
