"""Hostile chat requests from one tenant, one at a time (issue 20): each is answered, never with a 5xx and never
late, and after each another tenant's chat and memory upload answer and /healthz is 200. The cases are what JSON
allows at every sampling and decoding field: huge, negative, tiny, NaN/inf numbers, wrong types, odd strings."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import MODEL

TIMEOUT = 30
HOSTILE, BYSTANDER = "fuzz", "globex"
Q = [{"role": "user", "content": "who went camping?"}]
BASE = {"model": MODEL, "messages": Q, "max_tokens": 2}


def _deep(n: int) -> str:
    return "[" * n + "]" * n


# Raw JSON fragments for what json.dumps cannot write: NaN/Infinity (Python's parser takes them), huge literals.
RAW = {
    "NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity", "1e999": "1e999", "-1e999": "-1e999",
    "digits5000": "9" * 5000, "deep": _deep(5000), "deep900": _deep(900), "deep990": _deep(990),
    "deep_objects": '{"a":' * 950 + "1" + "}" * 950,
}
NUMBERS = [0, -1, 1, 2**31, 2**63, 2**64, -(2**64), 10**40, 1e-300, 5e-324, -0.0, 1e308, 0.5, "NaN", "Infinity",
           "-Infinity", "1e999", "digits5000"]
WRONG_TYPES = [None, True, "1", [], {"a": 1}]
FIELDS = ["seed", "temperature", "top_p", "max_tokens", "max_completion_tokens", "n", "min_tokens",
          "frequency_penalty", "presence_penalty", "top_logprobs", "logprobs"]


def _cases() -> list[tuple[str, dict | str]]:
    cases: list[tuple[str, dict | str]] = []
    for field in FIELDS:
        for v in NUMBERS + WRONG_TYPES:
            cases.append((f"{field}={v!r}", _with(field, v)))
    for v in [1e-300, 5e-324, 1e-6, 1e-3]:
        cases.append((f"temperature={v} stream", {**BASE, "temperature": v, "stream": True, "seed": 1}))
    cases.append(("seed=2**64 stream", {**BASE, "seed": 2**64, "temperature": 1.0, "stream": True}))
    cases.append(("top_p tiny sampled", {**BASE, "temperature": 2.0, "top_p": 5e-324, "seed": -(2**63)}))
    others = {
        "stop": [[], [""], ["a"] * 5, "x" * 300, ["\u0000"], [1, 2], {"a": 1}, ["<eos>"], ["\n"], " ", "\u202e",
                 ["<end_of_turn>", "<start_of_turn>"]],
        "logit_bias": [{"abc": 1}, {"-1": 100}, {"99999999999999999999": 1}, {"1": 1e308}, {"1": "NaN"}, [], "x",
                       {"1": 0}],
        "response_format": [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x"}},
                            {"type": 1}, "text", {"type": "text"}, {}],
        "tools": [[{"type": "function", "function": {"name": "f"}}], [], "deep", "deep900", "deep990", "deep_objects",
                  [None] * 1000],
        "tool_choice": ["auto", "required", {"type": "function", "function": {"name": "f"}}, "none", "deep900"],
        "user": ["", "x" * 100000, "alice@example.com", "\u0000", "../../etc/passwd", "%2e%2e", "\U0001f600" * 64],
        "inferscale": [{"k": -1}, {"k": 10**9}, {"mode": "bogus"}, {"mode": "kv-recompute", "recompute_ratio": 0},
                       {"mode": "kv-recompute", "recompute_ratio": 1}, {"recompute_ratio": "NaN"}, {"k": 0},
                       {"mode": "text", "k": 50}, "x", {"extra": 1}],
        "stream": ["yes", 1, None],
        "stream_options": [{"include_usage": "x"}, {"include_usage": True}, []],
        "metadata": [{"a": 1}, {str(i): "v" for i in range(100)}, {"k" * 100: "v"}, "deep_objects"],
        "model": ["", "x" * 10000, 123, None],
        "service_tier": ["flex", 1],
        "prompt_cache_key": ["x" * 2000],
        "ignore_eos": ["x", True],
        "modalities": [["audio"], ["text"], "text"],
        "unknown_field": [1],
    }
    for field, values in others.items():
        for v in values:
            cases.append((f"{field}={_short(v)}", _with(field, v)))
    for name, messages in _message_cases():
        cases.append((f"messages: {name}", {**BASE, "messages": messages}))
    text_nan = json.dumps({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "__"}]}]})
    deep_part = text_nan.replace('"__"', '"x", "extra": ' + RAW["deep900"])
    cases += [("text part NaN", text_nan.replace('"__"', "NaN")), ("deep message part", deep_part),
              ("body []", "[]"), ("body string", '"x"'), ("body number", "1"), ("body null", "null"),
              ("not json", "{not json"), ("empty body", ""), ("deep body", _deep(5000)),
              ("lone surrogate", '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL),
              ("duplicate keys", '{"model": "%s", "messages": [], "messages": %s}' % (MODEL, json.dumps(Q)))]
    return cases


def _message_cases() -> list[tuple[str, object]]:
    user = lambda content: [{"role": "user", "content": content}]  # noqa: E731
    return [
        ("empty list", []), ("empty content", user("")), ("no content", [{"role": "user"}]),
        ("system only", [{"role": "system", "content": "x"}]), ("tool only", [{"role": "tool", "content": "x"}]),
        ("bad role", [{"role": "hacker", "content": "x"}]), ("image part", user([{"type": "image_url"}])),
        ("empty parts", user([])), ("NULs", user("\u0000" * 1000)), ("zalgo", user("Z\u0336\u0335\u0334" * 500)),
        ("RTL override", user("\u202eabc\u202d")), ("replacement chars", user("\ufffd" * 200)),
        ("special tokens", user("<bos><eos><start_of_turn>model\n<end_of_turn>" * 20)),
        ("too long", user("caroline " * 100000)), ("many messages", [{"role": "user", "content": "a"}] * 20000),
        ("many turns", [{"role": r, "content": "hi"} for r in ("user", "assistant") * 400]),
        ("content number", user(5)), ("content null list", user([None])), ("message not object", ["hi"]),
    ]


def _with(field: str, value) -> dict | str:
    if isinstance(value, str) and value in RAW:
        return json.dumps({**BASE, field: "__RAW__"}).replace('"__RAW__"', RAW[value])
    return {**BASE, field: value}


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


CASES = _cases()


def _send(live, body: dict | str) -> httpx.Response:
    headers = {**live.headers(HOSTILE), "content-type": "application/json"}
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(live.url + "/v1/chat/completions", content=content, headers=headers, timeout=TIMEOUT)


def _bystander_served(live, full: bool) -> None:
    """/healthz is 200 (a dead engine worker fails it at once); with ``full`` another tenant's chat and memory
    upload also answer."""
    assert httpx.get(live.url + "/healthz", timeout=TIMEOUT).status_code == 200
    if not full:
        return
    r = httpx.post(live.url + "/v1/chat/completions", headers=live.headers(BYSTANDER), timeout=TIMEOUT,
                   json={"model": MODEL, "messages": Q, "max_tokens": 1})
    assert r.status_code == 200, r.text
    up = httpx.put(live.url + "/v1/memories/bystander", headers=live.headers(BYSTANDER), timeout=TIMEOUT,
                   json={"items": [{"id": "b1", "text": "the bystander is still served"}]})
    assert up.status_code == 200, up.text


def test_every_hostile_request_is_answered_and_others_are_served(live):
    assert len(CASES) > 250
    failures = []
    for i, (name, body) in enumerate(CASES):
        try:
            r = _send(live, body)
        except httpx.TimeoutException:
            failures.append((name, "no answer within 30 s"))
            continue
        if r.status_code >= 500:
            failures.append((name, r.status_code, r.text[:200]))
        elif r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (name, r.text)
        elif '"error"' in r.text and r.headers["content-type"].startswith("text/event-stream"):
            failures.append((name, "in-band error", r.text[-300:]))
        _bystander_served(live, full=i % 10 == 0)  # every 10th: chat and upload too (CI time)
    _bystander_served(live, full=True)
    assert not failures, failures


@pytest.mark.parametrize("path", ["/metrics", "/readyz", "/healthz"])
def test_no_tenant_activity_without_a_key(live, path):
    """Probes say only ready / not ready; /metrics needs the metrics token (a tenant key is not one)."""
    for headers in ({}, live.headers("acme"), {"Authorization": "Bearer wrong"}):
        r = httpx.get(live.url + path, headers=headers, timeout=TIMEOUT)
        if path == "/metrics":
            assert r.status_code == 401 and set(r.json()) == {"error"}
        else:
            assert r.status_code == 200 and set(r.json()) == {"status"}
    assert live.scrape().status_code == 200
