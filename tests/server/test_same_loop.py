"""``Engine.ask`` (what ``inferscale ask``, ``bench ttft`` and ``bench locomo`` call) and the server run the same
serving loop: the same request gives the same tokens."""

from __future__ import annotations

import pytest

from conftest import MODEL, SAMPLE
from inferscale.engine import MemoryItem, Sampling


@pytest.mark.parametrize("mode", ["kv", "text", "none"])
def test_engine_ask_and_server_return_the_same_answer(live, memories, tiny_engine, mode):
    question = "where did caroline move with her dog?"
    r = live.client().chat.completions.create(model=MODEL, user="caroline", max_tokens=8,
                                              messages=[{"role": "user", "content": question}],
                                              extra_body={"inferscale": {"k": 5, "mode": mode}})
    chosen = r.model_extra["inferscale"]["items"]
    blocks = {b.item_id: b for b in tiny_engine.encode([MemoryItem(m["id"], m["text"], timestamp=m.get("timestamp"))
                                                         for m in SAMPLE])}
    answer = tiny_engine.ask(question, [blocks[i] for i in chosen], mode, sampling=Sampling(max_new_tokens=8))
    assert r.choices[0].message.content == answer.text
    assert r.usage.completion_tokens == len(answer.token_ids)
    assert r.usage.prompt_tokens == answer.prompt_tokens
