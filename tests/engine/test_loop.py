"""The serving loop's request lifecycle on a tiny model: validation at add, cancellation, queue timeout, stops."""

from __future__ import annotations

import pytest

import tiny_models as tm
from inferscale.engine import Sampling
from inferscale.engine.loop import DoneEvent, ErrorEvent, GenRequest, ServingLoop, TokenEvent
from inferscale.engine.scheduler import SchedulerConfig
from inferscale.errors import EngineBusyError, InvalidInputError, PromptTooLongError


@pytest.fixture(scope="module")
def engine():
    return tm.engine("llama")


def req(engine, events, *, tokens=6, mode="none", tenant="default", ids=None, **kw):
    return GenRequest(ids=ids if ids is not None else engine.question_ids("where did caroline go?"), blocks=[],
                      mode=mode, sampling=Sampling(max_new_tokens=tokens, ignore_eos=True, **kw), emit=events.append,
                      tenant=tenant)


def test_bad_requests_fail_at_add_with_typed_errors(engine):
    loop = ServingLoop(engine)
    with pytest.raises(InvalidInputError):
        loop.add(req(engine, [], mode="fast"))
    with pytest.raises(InvalidInputError):
        loop.add(req(engine, [], ids=[]))
    with pytest.raises(PromptTooLongError):
        loop.add(req(engine, [], tokens=engine.loaded.layout.max_positions))
    assert not loop.has_work()


def test_cancel_frees_the_slot_and_ends_the_stream(engine):
    loop = ServingLoop(engine)
    kept, cancelled = [], []
    a, b = req(engine, kept, tokens=8), req(engine, cancelled, tokens=50, tenant="other")
    loop.add(a)
    loop.add(b)
    for _ in range(3):
        loop.step()
    b.cancel()
    loop.run_until_done()
    assert isinstance(kept[-1], DoneEvent) and kept[-1].completion_tokens == 8
    assert not any(isinstance(e, DoneEvent) for e in cancelled) and len(cancelled) < 50
    assert loop.rows == [] and loop.decoding == 0


def test_queue_timeout_answers_engine_busy(engine):
    loop = ServingLoop(engine, SchedulerConfig(max_running=1, queue_timeout_s=0.01))
    first, second = [], []
    loop.add(req(engine, first, tokens=30))
    loop.step()
    loop.add(req(engine, second, tenant="other"))
    import time

    time.sleep(0.05)
    loop.run_until_done()
    assert isinstance(first[-1], DoneEvent)
    assert len(second) == 1 and isinstance(second[0], ErrorEvent) and isinstance(second[0].error, EngineBusyError)


def test_events_are_tokens_then_one_done(engine):
    events = []
    loop = ServingLoop(engine)
    loop.add(req(engine, events, tokens=5))
    loop.run_until_done()
    assert all(isinstance(e, TokenEvent) for e in events[:-1]) and isinstance(events[-1], DoneEvent)
    done = events[-1]
    assert done.completion_tokens == 5 and done.finish_reason == "length"
    assert done.first_token == events[0].token_id


def test_min_tokens_bans_stop_tokens_until_reached(engine):
    """Without ignore_eos, min_tokens alone still forces the length (stop tokens cannot be chosen before it)."""
    events = []
    loop = ServingLoop(engine)
    r = GenRequest(ids=engine.question_ids("who?"), blocks=[], mode="none", emit=events.append,
                   sampling=Sampling(max_new_tokens=7, min_tokens=7))
    loop.add(r)
    loop.run_until_done()
    assert events[-1].completion_tokens == 7
