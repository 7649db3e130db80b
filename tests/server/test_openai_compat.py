"""OpenAI compatibility, driven with the official ``openai`` SDK against the live server: stop sequences (string,
list, streamed across token boundaries), the profile's default stop, max_completion_tokens, include_usage,
cached_tokens, 400 + param for what the server cannot honour, 429 only for rate (with Retry-After), x-request-id,
a first conversation without memories, and a free-form ``user`` (an e-mail)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

import tiny_models as tm
from conftest import MODEL

Q = [{"role": "user", "content": "What does Caroline like?"}]
FORCED = "Hello the dog went to paris"  # the tiny tokenizer: characters and a few words ("▁the", "▁dog")


def forced_output(engine, text: str = FORCED, then_newlines: bool = False):
    """``tiny_models.forced_output`` saying FORCED unless told otherwise."""
    return tm.forced_output(engine, text, then_newlines)


def ask(client, **kw):
    kw.setdefault("messages", Q)
    kw.setdefault("max_completion_tokens", 12)
    return client.chat.completions.create(model=MODEL, **kw)


def streamed(client, **kw) -> tuple[str, list[str], str | None]:
    """(streamed text, the non-empty deltas, finish_reason)."""
    deltas, reason = [], None
    for c in ask(client, stream=True, **kw):
        if c.choices:
            if c.choices[0].delta.content:
                deltas.append(c.choices[0].delta.content)
            reason = c.choices[0].finish_reason or reason
    return "".join(deltas), deltas, reason


# ---- stop -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stop", ["e do", ["zzz-not-said", "e do"], [" paris", "e do"]])
def test_stop_string_and_list_cut_the_answer(live, tiny_engine, stop):
    """The stop sequence spans two tokens (" the", " dog"); the earliest match wins; it is not returned."""
    c = live.client()
    with forced_output(tiny_engine):
        r = ask(c, stop=stop, extra_body={"ignore_eos": True})
        text, deltas, reason = streamed(c, stop=stop, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == "Hello th" and r.choices[0].finish_reason == "stop"
    assert text.strip() == "Hello th" and reason == "stop"
    assert not any("e" in d for d in deltas[-2:]), deltas  # the stream never sent the start of the stop sequence
    assert "".join(deltas).count("e") == 1, deltas


def test_stop_not_said_lets_the_answer_run_to_length(engine_live):
    c = engine_live.client()
    with forced_output(engine_live.app.state.engine):
        text, _, reason = streamed(c, stop=["zzz"], max_completion_tokens=6, extra_body={"ignore_eos": True})
    assert reason == "length" and text.strip() == "Hello the"


def test_default_stop_is_the_profiles_visible_and_overridable(engine_live):
    card = engine_live.client().models.list().data[0]
    assert card.model_extra["inferscale"]["default_stop"] == ["\n"]
    assert engine_live.client().models.retrieve(MODEL).model_extra["inferscale"]["default_stop"] == ["\n"]
    c = engine_live.client()
    with forced_output(engine_live.app.state.engine, "Hi", then_newlines=True):
        text, _, reason = streamed(c, max_completion_tokens=5)
    assert (text, reason) == ("Hi", "stop")  # the default: a line break ends the answer
    with forced_output(engine_live.app.state.engine, "Hi", then_newlines=True):
        text, _, reason = streamed(c, max_completion_tokens=5, stop=["zzz"])
    assert reason == "length" and text.startswith("Hi\n")  # a request's own stop replaces the default


def test_too_many_or_empty_stop_sequences_are_400(live):
    """The message says what is wrong with the value as sent, not that a list is not a string (``stop`` is a string
    or a list of them: pydantic reports a bad value once per member)."""
    for stop, param, says in ((["a", "b", "c", "d", "e"], "stop", "at most 4 items"),
                              ("", "stop", "at least 1 character"), ([""], "stop.0", "at least 1 character"),
                              (["x" * 300], "stop.0", "at most 256 characters")):
        with pytest.raises(openai.BadRequestError) as e:
            ask(live.client(), stop=stop)
        assert e.value.param == param, e.value.body
        assert says in e.value.message and "valid string" not in e.value.message, e.value.message


@pytest.mark.parametrize("field, literal", [("temperature", "NaN"), ("top_p", "Infinity"),
                                            ("presence_penalty", "-Infinity")])
def test_nan_and_infinity_are_400_as_not_finite(live, field, literal):
    """JSON's NaN and Infinity (which Python's parser takes) are refused as what they are: NaN is not "greater than
    2", which is what the range check alone said of it."""
    body = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (MODEL, field, literal)
    r = httpx.post(live.url + "/v1/chat/completions", content=body, timeout=30,
                   headers={**live.headers(), "content-type": "application/json"})
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (400, field), r.text
    assert "finite" in err["message"], err["message"]


# ---- lengths and usage --------------------------------------------------------------------------------------------
def test_max_completion_tokens_bounds_the_answer_and_wins_over_max_tokens(engine_live):
    c = engine_live.client()
    with forced_output(engine_live.app.state.engine):
        r = ask(c, max_completion_tokens=3, max_tokens=10, stop=["zzz"])
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_include_usage_sends_usage_null_before_the_last_chunk(engine_live):
    c = engine_live.client()
    with c.chat.completions.with_streaming_response.create(
            model=MODEL, messages=Q, max_completion_tokens=4, stream=True,
            stream_options={"include_usage": True}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 3
    assert all("usage" in ch and ch["usage"] is None for ch in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("mode", ["kv", "text"])
def test_cached_tokens_are_the_injected_memory_tokens(engine_live, engine_memories, mode):
    r = ask(engine_live.client(), user="caroline", extra_body={"inferscale": {"k": 3, "mode": mode}})
    memory_tokens = r.model_extra["inferscale"]["memory_tokens"]
    assert memory_tokens > 0
    expected = memory_tokens if mode == "kv" else 0  # text mode computes its memory tokens: none are cached
    assert r.usage.prompt_tokens_details.cached_tokens == expected
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


# ---- what the server cannot honour: 400 naming the param ----------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("kw, param", [
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [TOOL]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [TOOL["function"]]}, "functions"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"extra_body": {"best_of": 3}}, "best_of"),  # unknown fields: OpenAI's "Unrecognized request argument"
])
def test_unsupported_parameters_are_400_with_param(live, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        ask(live.client(), **kw)
    assert e.value.status_code == 400 and e.value.param == param, e.value.body


def test_harmless_values_of_known_fields_pass(live):
    r = ask(live.client(), logprobs=False, response_format={"type": "text"}, modalities=["text"], n=1,
            frequency_penalty=0, presence_penalty=0.0, tool_choice="none", metadata={"team": "a"},
            safety_identifier="hashed-123", prompt_cache_key="k1", service_tier="auto")
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kw, param", [
    ({"extra_body": {"inferscale": {"k": 4}}}, "inferscale.k"),
    ({"max_completion_tokens": 9}, "max_completion_tokens"),
    ({"max_tokens": 9, "max_completion_tokens": None}, "max_tokens"),
])
def test_over_limit_values_are_400_not_429(live, kw, param):
    """tight allows k <= 3 and 8 tokens: a 429 would make the SDK retry a request that can never pass."""
    with pytest.raises(openai.BadRequestError) as e:
        kw = {k: v for k, v in kw.items() if v is not None}
        live.client("tight").chat.completions.create(model=MODEL, messages=Q, **kw)
    assert e.value.param == param, e.value.body


def test_429_only_for_rate_and_with_retry_after(live):
    c = live.client("tight")
    stream = c.chat.completions.create(model=MODEL, messages=Q, stream=True, max_completion_tokens=8)
    next(iter(stream))  # one request in flight: tight's limit
    try:
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(model=MODEL, messages=Q, max_completion_tokens=2)
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        list(stream)
        stream.close()


# ---- x-request-id ---------------------------------------------------------------------------------------------
def test_x_request_id_is_echoed_and_on_the_span(live):
    c = live.client()
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=Q, max_completion_tokens=2,
                                                      extra_headers={"x-request-id": "gw-42:abc"})
    assert raw.headers["x-request-id"] == "gw-42:abc"
    assert raw.parse().id.startswith("chatcmpl-")
    chat = [s for s in live.spans.get_finished_spans() if s.attributes.get("inferscale.request_id") == "gw-42:abc"]
    assert chat and chat[0].name == f"chat {MODEL}"
    own = c.chat.completions.with_raw_response.create(model=MODEL, messages=Q, max_completion_tokens=2,
                                                      extra_headers={"x-request-id": "x" * 500})
    assert own.headers["x-request-id"] and len(own.headers["x-request-id"]) <= 128  # too long: replaced
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=Q, logprobs=True, extra_headers={"x-request-id": "bad-1"})
    assert e.value.response.headers["x-request-id"] == "bad-1"  # errors carry it too


# ---- users ------------------------------------------------------------------------------------------------------
def test_first_conversation_without_memories_is_answered(engine_live):
    r = ask(engine_live.client(), user="brand-new-user-7", extra_body={"inferscale": {"k": 5, "mode": "kv"}})
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.model_extra["inferscale"]["items"] == [] and r.model_extra["inferscale"]["memory_tokens"] == 0
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_an_email_user_stores_memories_and_chats_with_them(engine_live):
    from inferscale.contract import user_store_id

    user = "ann@example.com"
    r = httpx.put(f"{engine_live.url}/v1/memories/{user}", headers=engine_live.headers(), timeout=60,
                  json={"items": [{"id": "a1", "text": "ann keeps bees in her garden"}]})
    assert r.status_code == 200, r.text
    assert r.json()["user"] == user_store_id(user)
    chat = ask(engine_live.client(), user=user, extra_body={"inferscale": {"k": 2}})
    assert chat.model_extra["inferscale"]["items"] == ["a1"]
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    listed = httpx.get(f"{engine_live.url}/v1/memories/{user}", headers=engine_live.headers()).json()
    assert [i["id"] for i in listed["items"]] == ["a1"]


def test_user_mapping_is_one_to_one():
    from inferscale.contract import is_valid_id, user_store_id

    assert user_store_id("caroline") == "caroline"  # valid ids keep their name (operator-made users match)
    hashed = user_store_id("ann@example.com")
    assert hashed.startswith("u-") and is_valid_id(hashed) and hashed == user_store_id("ann@example.com")
    # A valid id of the hashed shape is hashed too, so it can never collide with the string it looks like a hash of.
    assert user_store_id(hashed) != hashed
    assert user_store_id("a..b") != user_store_id("a.b") and is_valid_id(user_store_id("../etc"))
    assert user_store_id("u-short") == "u-short"
