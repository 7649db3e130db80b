"""Open-ended questions get answers: a model that opens its answer with a line break (as Gemma does for "Describe
...") must not be cut off before it says anything. vLLM's ``ignore_eos``/``min_tokens`` force the length."""

from __future__ import annotations

import contextlib

import pytest

import tiny_models as tm
from conftest import MODEL

QUESTIONS = ["Describe Ilse's life in Porto", "What are Ilse's hobbies? Explain each of them."]


@contextlib.contextmanager
def opens_with_newline(engine):
    """Make the model's first token of every answer a line break (as Gemma-3's is for these questions): a pass over
    more than one new token (the end of a prompt) strongly prefers the newline token, a decode pass avoids it (the
    tiny random model would otherwise repeat it forever)."""
    newline = engine.tokenizer.convert_tokens_to_ids("\n")
    assert newline in engine.newline_ids

    def hook(_module, _args, kwargs, output):
        output.logits[..., newline] += 1000.0 if kwargs["input_ids"].shape[1] > 1 else -1000.0
        return output

    with tm.logit_hook(engine, hook):
        yield


@pytest.mark.parametrize("mode", ["kv", "text", "none", "kv-recompute"])
def test_open_ended_questions_get_non_empty_answers(live, memories, tiny_engine, mode):
    client = live.client()
    with opens_with_newline(tiny_engine):
        for question in QUESTIONS:
            r = client.chat.completions.create(model=MODEL, user="caroline", max_tokens=12,
                                               messages=[{"role": "user", "content": question}],
                                               extra_body={"inferscale": {"k": 3, "mode": mode}})
            assert r.choices[0].message.content.strip(), (mode, question, r)
            assert r.usage.completion_tokens > 0


def test_ignore_eos_and_min_tokens_force_the_length(live, tiny_engine):
    client = live.client()
    with opens_with_newline(tiny_engine):  # a newline would otherwise stop the answer early
        for extra in ({"ignore_eos": True}, {"min_tokens": 10}):
            stream = client.chat.completions.create(
                model=MODEL, max_tokens=10, stream=True, stream_options={"include_usage": True},
                messages=[{"role": "user", "content": "hi"}], extra_body=extra)
            usage = [c.usage for c in stream if c.usage is not None]
            assert usage and usage[0].completion_tokens == 10, extra
