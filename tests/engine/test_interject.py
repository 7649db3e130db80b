"""Another tenant's short prompt runs between two layers of a pass in progress (inferscale/engine/interject.py): its
first token comes before the paused pass ends, and every answer, the paused pass's included, is bit for bit what it
is without the interjection. A tiny Gemma-3 with lean layers (the hook lives in the lean pass)."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from inferscale.engine import Engine, Sampling
from inferscale.engine.loop import DoneEvent, GenRequest, ServingLoop, TokenEvent
from inferscale.engine.scheduler import SchedulerConfig
from inferscale.models.loader import from_model

CONFIG = SchedulerConfig(chunk_tokens=64)  # newcomers of up to 64 prompt tokens interject (NEWCOMER_PASS_TOKENS)


@pytest.fixture(scope="module")
def engine():
    return Engine(from_model(tm.model("gemma3", dtype=torch.bfloat16, sliding_window=8), tm.tokenizer()))


def _request(engine, log: list, name: str, tenant: str, ids: list[int], tokens: int) -> GenRequest:
    return GenRequest(ids=ids, blocks=[], mode="none", tenant=tenant, emit=lambda e: log.append((name, e)),
                      sampling=Sampling(max_new_tokens=tokens, ignore_eos=True))


class _Span:
    def __init__(self, spans: list, name: str, attributes: dict) -> None:
        self.name, self.attributes = name, dict(attributes)
        spans.append(self)

    def set_attribute(self, key: str, value: object) -> None:
        self.attributes[key] = value

    def record_exception(self, *_: object) -> None: ...

    def end(self) -> None: ...


class _Tracer:
    """Records the engine's child spans (prefill, decode) of one request."""

    def __init__(self) -> None:
        self.spans: list[_Span] = []

    def start_span(self, name: str, context=None, attributes=None) -> _Span:
        return _Span(self.spans, name, attributes or {})


def _tokens(log: list, name: str) -> list[int]:
    return [e.token_id for n, e in log if n == name and isinstance(e, TokenEvent) and e.token_id is not None]


def _alone(engine, ids: list[int], tokens: int) -> list[int]:
    log: list = []
    loop = ServingLoop(engine, CONFIG)
    loop.add(_request(engine, log, "x", "solo", ids, tokens))
    loop.run_until_done()
    return _tokens(log, "x")


def _arriving_during_first_pass(loop: ServingLoop, newcomer: GenRequest, after_steps: int = 0) -> list[int]:
    """Queue ``newcomer`` when the interjector first looks for one (between two layers of a pass) once the loop has
    run ``after_steps`` steps; returns [the step it was queued in]."""
    queued: list[int] = []
    take = loop.scheduler.take_newcomer

    def arriving(busy, fits):
        if not queued and loop.steps >= after_steps:
            queued.append(loop.steps)
            loop.add(newcomer)
        return take(busy, fits)

    loop.scheduler.take_newcomer = arriving
    return queued


@pytest.mark.parametrize("b_tokens", [1, 5])
def test_a_newcomer_is_answered_inside_another_tenants_prompt_pass(engine, b_tokens):
    long_prompt = engine.tokenizer("memory " * 150, add_special_tokens=False).input_ids[:150]
    question = engine.question_ids("where did caroline go?")
    log: list = []
    loop = ServingLoop(engine, CONFIG)
    a, b = _request(engine, log, "a", "tenant-a", long_prompt, 4), _request(engine, log, "b", "tenant-b", question,
                                                                             b_tokens)
    a.tracer, b.tracer = _Tracer(), _Tracer()
    loop.add(a)
    queued = _arriving_during_first_pass(loop, b)
    loop.step()  # A's first 64-token prompt pass, paused between two layers for B's whole question
    assert queued == [0]
    assert len(_tokens(log, "b")) == 1  # B's first token inside the step that ran A's pass
    assert loop.scheduler.num_waiting == 0
    loop.run_until_done()
    assert _tokens(log, "a") == _alone(engine, long_prompt, 4)
    assert _tokens(log, "b") == _alone(engine, question, b_tokens)
    assert all(isinstance(next(e for n, e in reversed(log) if n == who), DoneEvent) for who in "ab")
    assert loop.rows == [] and loop.decoding == 0 and loop._settling == []
    interjected = {r: [s.name for s in r.tracer.spans if s.attributes.get("inferscale.interjected")] for r in (a, b)}
    assert interjected == {a: [], b: ["prefill"]}  # B's trace shows where its prompt ran


def test_a_newcomer_is_answered_inside_another_tenants_decode_pass(engine):
    questions = [engine.question_ids(q) for q in ("what does maya do?", "who is lena?", "where is biscuit?")]
    log: list = []
    loop = ServingLoop(engine, CONFIG)
    for i, ids in enumerate(questions[:2]):
        loop.add(_request(engine, log, f"a{i}", "tenant-a", ids, 8))
    loop.step()  # both prompts
    assert loop.decoding == 2
    queued = _arriving_during_first_pass(loop, _request(engine, log, "b", "tenant-b", questions[2], 6), 1)
    loop.step()  # A's decode pass, paused for B's question
    assert queued == [1] and len(_tokens(log, "b")) == 1 and loop.decoding == 3
    loop.run_until_done()
    for i, ids in enumerate(questions[:2]):
        assert _tokens(log, f"a{i}") == _alone(engine, ids, 8)
    assert _tokens(log, "b") == _alone(engine, questions[2], 6)
    assert loop.rows == [] and loop.decoding == 0


def test_the_pass_s_own_tenant_and_long_prompts_wait_for_the_next_step(engine):
    long_prompt = engine.tokenizer("memory " * 150, add_special_tokens=False).input_ids[:150]
    question = engine.question_ids("where did caroline go?")
    for tenant, ids in (("tenant-a", question), ("tenant-b", long_prompt[:100])):
        log: list = []
        loop = ServingLoop(engine, CONFIG)
        loop.add(_request(engine, log, "a", "tenant-a", long_prompt, 2))
        queued = _arriving_during_first_pass(loop, _request(engine, log, "b", tenant, ids, 2))
        loop.step()
        assert queued == [0] and _tokens(log, "b") == [] and loop.scheduler.num_waiting == 1, tenant
        loop.run_until_done()
        assert len(_tokens(log, "b")) == 2


def test_a_tenants_next_question_interjects_in_the_same_pass_after_the_other_tenants(engine):
    """Tenant B's next question, sent as its first was answered inside A's pass, waited out the rest of that pass
    (once a pass a tenant; through the server a 56-row decode pass: 105 ms against 36-45 ms). It goes in the same
    pass too, after tenant C's, which had not interjected yet."""
    long_prompt = engine.tokenizer("memory " * 150, add_special_tokens=False).input_ids[:150]
    log: list = []
    loop = ServingLoop(engine, CONFIG)
    loop.interject.budget_s = 10.0
    loop.add(_request(engine, log, "a", "tenant-a", long_prompt, 2))
    b1, b2, c = (_request(engine, log, name, f"tenant-{name[0]}", engine.question_ids(f"who is {name}?"), 2)
                 for name in ("b1", "b2", "c"))
    take, looks = loop.scheduler.take_newcomer, []

    def arriving(busy, fits):
        looks.append(busy)
        if len(looks) == 1:
            loop.add(b1)
        elif len(looks) == 2:  # the next layer: b1 was answered
            loop.add(b2)
            loop.add(c)
        return take(busy, fits)

    loop.scheduler.take_newcomer = arriving
    loop.step()  # A's first prompt pass
    firsts = [n for n, e in log if isinstance(e, TokenEvent)]
    assert firsts == ["b1", "c", "b2"] and loop.scheduler.num_waiting == 0
    loop.run_until_done()
    assert _tokens(log, "a") == _alone(engine, long_prompt, 2)


@pytest.mark.parametrize("budget_s, answered", [(10.0, 2), (1e-9, 1)])
def test_a_pass_waits_for_newcomers_up_to_its_budget(engine, budget_s, answered):
    long_prompt = engine.tokenizer("memory " * 150, add_special_tokens=False).input_ids[:150]
    log: list = []
    loop = ServingLoop(engine, CONFIG)
    loop.interject.budget_s = budget_s
    loop.add(_request(engine, log, "a", "tenant-a", long_prompt, 2))
    newcomers = [_request(engine, log, name, f"tenant-{name}", engine.question_ids(f"who is {name}?"), 2)
                 for name in ("b", "c")]
    take = loop.scheduler.take_newcomer

    def arriving(busy, fits):
        while newcomers:
            loop.add(newcomers.pop(0))
        return take(busy, fits)

    loop.scheduler.take_newcomer = arriving
    loop.step()
    assert sum(len(_tokens(log, name)) for name in "bc") == answered  # one token each, inside A's pass
    loop.run_until_done()
    assert loop.rows == [] and loop.decoding == 0


def test_a_newcomer_interjected_under_a_full_kv_budget_leaves_the_paused_pass_intact(engine):
    """The paused pass's rows hold some layers' K/V of tokens past their lengths: the newcomer's admission, which
    fills the K/V budget, must not give those pages back as left behind (``ServingLoop._trim``), or A's answer
    changes. Sampled at temperature 1 with a seed: a random tiny model's greedy tokens barely follow its cache."""
    import dataclasses

    def sampled(log, name, tenant, ids, tokens):
        return GenRequest(ids=ids, blocks=[], mode="none", tenant=tenant, emit=lambda e: log.append((name, e)),
                          sampling=Sampling(max_new_tokens=tokens, ignore_eos=True, temperature=1.0, seed=7))

    long_prompt = engine.tokenizer("memory " * 150, add_special_tokens=False).input_ids[:150]
    question = engine.question_ids("where did caroline go?")
    prefix = len(engine.prefix_ids)
    budget = (prefix + len(long_prompt) + 8) + (prefix + len(question) + 1)  # both, to the token: no room left
    alone: list = []
    solo = ServingLoop(engine, CONFIG)
    solo.add(sampled(alone, "a", "tenant-a", long_prompt, 8))
    solo.run_until_done()
    log: list = []
    loop = ServingLoop(engine, dataclasses.replace(CONFIG, kv_tokens=budget), slots=1, slot_tokens=8)
    loop.add(sampled(log, "a", "tenant-a", long_prompt, 8))
    queued = _arriving_during_first_pass(loop, sampled(log, "b", "tenant-b", question, 1), after_steps=1)
    loop.step()
    loop.step()  # A's second chunk, tokens 109-172, paused after its first layer; 128-172 fill a page of their own
    assert queued == [1] and len(_tokens(log, "b")) == 1
    loop.run_until_done()
    assert _tokens(log, "a") == _tokens(alone, "a") and len(_tokens(alone, "a")) == 8
