"""Hostile input in CI (issue 20): property-based fuzzing of the chat and memories APIs through the live server
(uvicorn on loopback over the tiny engine, tests/server/conftest.py):
  1. hypothesis bodies derived from the request schemas (tests/server/hostile.py) for chat and memories;
  2. schemathesis over the server's own OpenAPI document, every operation, positive and negative cases.
No answer may be a 5xx, an in-band stream error or later than 30 s, and afterwards another tenant is served.

Budget: the example counts below, about 60-90 s on 2 CPU cores in all. The seed is INFERSCALE_FUZZ_SEED (fixed by
default, so CI is repeatable; set another to explore); each test prints its seed and example count. Driven through
hypothesis directly (schemathesis' pytest plugin does not run under pytest 9)."""

from __future__ import annotations

import os
from collections import Counter
from urllib.parse import quote

import httpx
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                              response_schema_conformance, status_code_conformance)
from schemathesis.generation.modes import GenerationMode

import hostile
from conftest import KEYS, MODEL
from inferscale.server.schemas import ChatCompletionRequest, PutMemories

SEED = int(os.environ.get("INFERSCALE_FUZZ_SEED", "20"))
CHAT_EXAMPLES = 600
MEMORY_EXAMPLES = 100
SCHEMA_EXAMPLES = {"/v1/chat/completions": 60, "/v1/memories/{user}": 15}  # per operation and mode
OTHER_OPERATION_EXAMPLES = 4
TIMEOUT = 30  # a hang is a failure: httpx raises
TENANT, BYSTANDER = "fuzz", "globex"
# What schemathesis holds the answers to, beyond "no 5xx": documented status, content type and body schema, and an
# invalid request refused. Not positive_data_acceptance: two refusals the schema cannot express (a repeated memory
# id in one PUT, a chat without a user message) are 400s by design (docs/interfaces.md).
CONFORMANCE = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
               negative_data_rejection]


def _settings(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _no_server_error(r: httpx.Response, what: str) -> None:
    assert r.status_code < 500, (what, r.status_code, r.text[:500])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert '"error"' not in r.text, (what, r.text[-500:])
    elif r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, (what, r.text[:500])


def _others_served(live) -> None:
    assert httpx.get(live.url + "/healthz", timeout=TIMEOUT).status_code == 200
    r = httpx.post(live.url + "/v1/chat/completions", headers=live.headers(BYSTANDER), timeout=TIMEOUT,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    up = httpx.put(live.url + "/v1/memories/after-fuzz", headers=live.headers(BYSTANDER), timeout=TIMEOUT,
                   json={"items": [{"id": "a1", "text": "served after the fuzz"}]})
    assert up.status_code == 200, up.text


def _report(capsys, name: str, statuses: Counter) -> None:
    with capsys.disabled():
        print(f"\nfuzz {name}: seed {SEED}, {sum(statuses.values())} examples, statuses {dict(sorted(statuses.items()))}")


def test_chat_bodies_from_the_request_schema(live, capsys):
    statuses: Counter = Counter()
    with httpx.Client(base_url=live.url, headers=live.headers(TENANT), timeout=TIMEOUT) as http:

        @seed(SEED)
        @_settings(CHAT_EXAMPLES)
        @given(body=hostile.bodies(ChatCompletionRequest, hostile.BASES["ChatCompletionRequest"]))
        def post(body):
            text = hostile.dumps(body)
            r = http.post("/v1/chat/completions", content=text, headers={"content-type": "application/json"})
            statuses[r.status_code] += 1
            _no_server_error(r, text[:300])

        post()
    _report(capsys, "chat (hypothesis, schema-derived)", statuses)
    assert statuses[200] and sum(n for s, n in statuses.items() if 400 <= s < 500)
    _others_served(live)


def test_memories_from_the_request_schema(live, capsys):
    statuses: Counter = Counter()
    with httpx.Client(base_url=live.url, headers=live.headers(TENANT), timeout=TIMEOUT) as http:

        @seed(SEED)
        @_settings(MEMORY_EXAMPLES)
        @given(user=hostile.users, body=hostile.bodies(PutMemories, hostile.BASES["PutMemories"]))
        def put(user, body):
            path = "/v1/memories/" + quote(user, safe="")
            text = hostile.dumps(body)
            for r in (http.put(path, content=text, headers={"content-type": "application/json"}),
                      http.get(path), http.delete(path + "/m1"), http.delete(path)):
                statuses[r.status_code] += 1
                _no_server_error(r, f"{r.request.method} {path} {text[:300]}")

        put()
    _report(capsys, "memories (hypothesis, schema-derived)", statuses)
    _others_served(live)


def test_every_operation_of_the_openapi_document(live, capsys):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 8  # chat, memories (4), models (2), probes (2); /metrics is not in the document
    statuses: Counter = Counter()
    for op in ops:
        token = "internal-secret" if op.path.startswith("/internal") else KEYS[TENANT]
        examples = SCHEMA_EXAMPLES.get(op.path, OTHER_OPERATION_EXAMPLES)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @seed(SEED)
            @_settings(examples)
            @given(case=op.as_strategy(generation_mode=mode))
            def call(case):
                resp = case.call_and_validate(base_url=live.url, headers={"Authorization": f"Bearer {token}"},
                                              checks=CONFORMANCE, timeout=TIMEOUT)
                statuses[resp.status_code] += 1

            try:
                call()
            except Unsatisfiable:  # nothing to break (no parameters, or any string is allowed): no negative case
                assert mode is GenerationMode.NEGATIVE and not list(op.body), op.label
    _report(capsys, f"OpenAPI (schemathesis {schemathesis.__version__}, {len(ops)} operations)", statuses)
    assert statuses and all(s < 500 for s in statuses)
    _others_served(live)
