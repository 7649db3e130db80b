"""Admission before the engine: prompt length checked in characters before any tokenizer sees it (issue 12: a huge
message was tokenized on the engine thread), and a full tenant queue answers 503 + Retry-After."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from transformers import PreTrainedTokenizerFast

from conftest import MODEL


def test_huge_message_is_refused_before_tokenization(live, tiny_engine, monkeypatch):
    limit = tiny_engine.loaded.layout.max_positions * 16  # engine.worker.CHARS_PER_TOKEN_LIMIT characters a token
    seen: list[int] = []
    original = PreTrainedTokenizerFast.__call__

    def spy(self, text=None, *args, **kwargs):
        if isinstance(text, str):
            seen.append(len(text))
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", spy)
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(model=MODEL, max_tokens=2,
                                              messages=[{"role": "user", "content": "a " * (limit // 2 + 1)}])
    assert e.value.body["code"] == "context_length_exceeded"
    assert all(n <= limit for n in seen), "the oversized prompt reached a tokenizer"


def test_a_request_needing_more_kv_than_the_server_holds_is_refused_with_400(live):
    """INFERSCALE_KV_CACHE_BYTES bounds what the running requests hold, each at its prompt + max_tokens: one that alone
    needs more is refused at once, naming what it needs (it could never run), and the next request is served."""
    from inferscale.engine.capacity import Capacity

    scheduler = live.app.state.worker.loop.scheduler
    ask = dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "where did caroline go?"}])
    slots = scheduler.config.max_running
    saved, scheduler.capacity = scheduler.capacity, Capacity(slots, 8)  # fewer tokens than the chat template's
    try:
        with pytest.raises(openai.BadRequestError) as e:
            live.client().chat.completions.create(**ask)
        assert e.value.body["code"] == "context_length_exceeded" and "K/V" in e.value.body["message"]
    finally:
        scheduler.capacity = saved
    assert live.client().chat.completions.create(**ask).usage.completion_tokens >= 1 and saved.held == 0


def test_full_tenant_queue_answers_503_with_retry_after(live):
    from inferscale.engine.scheduler import SchedulerConfig
    from inferscale.engine.worker import _Call

    worker = live.app.state.worker
    scheduler = worker.loop.scheduler
    saved = scheduler.config
    scheduler.config = SchedulerConfig(max_running=1, max_queued_per_tenant=1, queue_timeout_s=60)
    client = live.client()
    busy = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "the the the"}],
                extra_body={"ignore_eos": True})
    # Hold the engine thread between two steps, so the queue fills deterministically (no race with decoding).
    gate, holding = threading.Event(), threading.Event()
    hold = _Call(lambda _engine: (holding.set(), gate.wait(60)))
    with worker._cv:
        worker._calls.append(hold)
        worker._cv.notify()
    waiting = threading.Thread(target=client.chat.completions.create, kwargs=busy)
    try:
        assert holding.wait(30)
        waiting.start()  # the tenant's one queue place
        for _ in range(2000):
            if scheduler.num_waiting >= 1:
                break
            threading.Event().wait(0.005)
        assert scheduler.num_waiting == 1
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(**busy)
        assert e.value.status_code == 503
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["code"] == "engine_busy"
    finally:
        gate.set()
        hold.future.result(30)
        if waiting.is_alive() or waiting.ident is not None:
            waiting.join(60)
        scheduler.config = saved


def test_a_text_request_is_announced_with_its_memories_before_retrieval(live, memories, monkeypatch):
    """Announced at its question's tokens alone, a flood of long text requests was refused only after each one's
    retrieval (issue 22): the k memories it pastes count from the start, at the user's mean memory size."""
    worker = live.app.state.worker
    announced: list[int] = []
    original = worker.expect

    modes: list[str] = []

    def spy(tenant: str, prompt_tokens: int = 0, mode: str = "", new_tokens: int = 0):
        announced.append(prompt_tokens)
        modes.append(mode)  # a tenant's typical prompt is kept by mode (scheduler.py)
        return original(tenant, prompt_tokens, mode, new_tokens)

    monkeypatch.setattr(worker, "expect", spy)
    client = live.client()

    def ask(mode: str, k: int):
        return client.chat.completions.create(
            model=MODEL, max_tokens=1, user="caroline", messages=[{"role": "user", "content": "Where did she move?"}],
            extra_body={"inferscale": {"k": k, "mode": mode}})

    none, every = ask("none", 5), ask("text", len(memories))
    # With k = all of them every memory is pasted: the announcement is the whole prompt, known before retrieval.
    assert announced[1] - announced[0] == every.usage.prompt_tokens - none.usage.prompt_tokens > 0
    ask("text", 2)
    assert announced[0] < announced[2] < announced[1]
    ask("kv", 5)  # injected memories are not prompt tokens to compute
    assert announced[3] == announced[0] and modes == ["none", "text", "text", "kv"]


def test_a_tenant_filling_the_kv_budget_does_not_hold_up_another_tenants_request(live):
    """Attack through the server: tenant acme's long-running requests would fill the K/V budget, and with no
    preemption globex's request would wait for one of them to end. acme may hold its part of what the reserve leaves;
    globex's first request fits beside it and ends before any of acme's."""
    from inferscale.engine.capacity import Capacity

    scheduler = live.app.state.worker.loop.scheduler
    long = dict(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "the the the"}],
                extra_body={"ignore_eos": True, "inferscale": {"mode": "none"}})
    prompt = live.client().chat.completions.create(**{**long, "max_tokens": 1}).usage.prompt_tokens
    need = prompt + 64
    slots = scheduler.config.max_running  # a lone tenant's part of the K/V below: 2 x need
    saved, scheduler.capacity = scheduler.capacity, Capacity(slots, 3 * need + 1, token_reserve=need + 1)
    ends: dict[str, float] = {}

    def ask(tenant: str, name: str, **kw) -> None:
        live.client(tenant).chat.completions.create(**{**long, **kw})
        ends[name] = time.monotonic()

    acme = [threading.Thread(target=ask, args=("acme", f"acme{i}")) for i in range(3)]
    try:
        for t in acme:
            t.start()
        for _ in range(2000):
            if scheduler.capacity.held >= 2 * need:
                break
            time.sleep(0.005)
        time.sleep(0.05)  # steps: all three would be admitted by now if the budget alone bounded them
        ask("globex", "globex", max_tokens=4)
        for t in acme:
            t.join(120)
    finally:
        scheduler.capacity = saved
    assert len(ends) == 4 and ends["globex"] < min(ends[f"acme{i}"] for i in range(3)), ends
