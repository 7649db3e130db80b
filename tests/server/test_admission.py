"""Admission before the engine: prompt length checked in characters before any tokenizer sees it (issue 12: a huge
message was tokenized on the engine thread), and a full tenant queue answers 503 + Retry-After."""

from __future__ import annotations

import threading

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


def test_full_tenant_queue_answers_503_with_retry_after(live):
    from inferscale.engine.scheduler import SchedulerConfig

    scheduler = live.app.state.worker.loop.scheduler
    saved = scheduler.config
    scheduler.config = SchedulerConfig(max_running=1, max_queued_per_tenant=1, queue_timeout_s=60)
    client = live.client()
    busy = dict(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "the the the"}],
                extra_body={"ignore_eos": True})
    try:
        running = [threading.Thread(target=client.chat.completions.create, kwargs=busy) for _ in range(2)]
        for t in running:
            t.start()
        # one request holds the only slot, one waits in the queue: the next is refused until they are done
        deadline = 0
        while scheduler.num_running + scheduler.num_waiting < 2 and deadline < 2000:
            threading.Event().wait(0.005)
            deadline += 1
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(**busy)
        assert e.value.status_code == 503
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["code"] == "engine_busy"
        for t in running:
            t.join(60)
    finally:
        scheduler.config = saved
