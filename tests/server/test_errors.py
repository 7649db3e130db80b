"""Bad input answers 4xx with an OpenAI-style error body, never a 500."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import MODEL

Q = [{"role": "user", "content": "who went camping?"}]


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("body,status,code", [
    ("{not json", 400, "invalid_json"),
    ("[]", 400, "invalid_value"),
    ({"model": "gpt-4o", "messages": Q}, 404, "model_not_found"),
    ({"model": MODEL, "messages": []}, 400, "invalid_value"),
    ({"model": MODEL}, 400, "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "   "}]}, 400, None),
    ({"model": MODEL, "messages": [{"role": "assistant", "content": "hi"}]}, 400, None),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value"),
    ({"model": MODEL, "messages": Q, "inferscale": {"k": -1}}, 400, "invalid_value"),
    ({"model": MODEL, "messages": Q, "inferscale": {"k": 100000}}, 400, "invalid_value"),
    ({"model": MODEL, "messages": Q, "inferscale": {"mode": "telepathy"}}, 400, "invalid_value"),
    ({"model": MODEL, "messages": Q, "max_tokens": 0}, 400, "invalid_value"),
    ({"model": MODEL, "messages": Q, "ignore_eos": 1}, 400, "invalid_value"),  # a bool, not 1 (schemathesis ST201)
    ({"model": MODEL, "messages": Q, "n": 2}, 400, "invalid_value"),
    ({"model": MODEL, "messages": Q, "user": "x" * 257}, 400, "invalid_value"),
    ({"model": MODEL, "messages": Q, "inferscale": {"k": 51}}, 400, "k_limit_exceeded"),
    ({"model": MODEL, "messages": Q, "max_tokens": 65}, 400, "max_tokens_limit_exceeded"),
    ({"model": MODEL, "messages": Q, "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens_exceeds_max_tokens"),
    ({"model": MODEL, "messages": Q, "min_tokens": 10**30}, 400, "min_tokens_exceeds_max_tokens"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_chat_requests(live, body, status, code, stream):
    if isinstance(body, dict):
        body = {**body, "stream": stream}
        r = httpx.post(live.url + "/v1/chat/completions", json=body, headers=live.headers())
    else:
        r = httpx.post(live.url + "/v1/chat/completions", content=body,
                       headers={**live.headers(), "content-type": "application/json"})
    err = _err(r, status)
    if code:
        assert err["code"] == code


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_too_long(live, stream):
    # The tiny model's context is 2048 positions.
    long = " ".join(["caroline"] * 3000)
    r = httpx.post(live.url + "/v1/chat/completions", headers=live.headers(),
                   json={"model": MODEL, "messages": [{"role": "user", "content": long}], "stream": stream})
    assert _err(r, 400)["code"] == "context_length_exceeded"


def test_body_too_large(live):
    r = httpx.post(live.url + "/v1/chat/completions", headers={**live.headers(), "content-type": "application/json"},
                   content=b"x" * (live.settings.max_body_bytes + 1))
    _err(r, 413)


def test_bad_memories(live):
    h, u = live.headers(), live.url + "/v1/memories/"
    _err(httpx.put(u + "bob", json={"items": []}, headers=h), 400)
    _err(httpx.put(u + "bob", json={"items": [{"id": "bad id", "text": "x"}]}, headers=h), 400)
    _err(httpx.put(u + "bob", json={"items": [{"id": "a", "text": " "}]}, headers=h), 400)
    _err(httpx.put(u + "bob", json={"items": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]}, headers=h), 400)
    _err(httpx.put(u + "bob", content=b"{", headers={**h, "content-type": "application/json"}), 400)
    _err(httpx.put(u + "bob", json={"items": [{"id": "a", "text": "x"}], "replace": 0}, headers=h), 400)  # not a bool
    _err(httpx.put(u + "x" * 257, json={"items": [{"id": "a", "text": "x"}]}, headers=h), 400)  # user over 256
    _err(httpx.get(u + "never-seen", headers=h), 404)
    _err(httpx.get(live.url + "/v1/nothing-here", headers=h), 404)


@pytest.mark.parametrize("method,path,allowed", [
    ("OPTIONS", "/v1/memories/bob", {"DELETE", "GET", "PUT"}),  # three routes share the path
    ("PATCH", "/v1/memories/bob/a1", {"DELETE"}),
    ("GET", "/v1/chat/completions", {"POST"}),
])
def test_method_not_allowed_names_every_method_of_the_path(live, method, path, allowed):
    """405's Allow lists what the path serves, all routes of it (schemathesis ST205 found ``Allow: PUT`` alone)."""
    r = httpx.request(method, live.url + path, headers=live.headers())
    _err(r, 405)
    assert {m.strip() for m in r.headers["allow"].split(",")} - {"HEAD"} == allowed


def test_openapi_documents_the_errors_it_answers(live):
    """Every operation documents its 4xx/5xx answers as the error body they are, and no 422, which this server never
    answers (schemathesis ST103 found a 404 from GET /v1/models/{id} documented as neither)."""
    doc = httpx.get(live.url + "/openapi.json").json()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            assert op["responses"]["4XX"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorBody"}, (method, path)
    r = httpx.get(live.url + "/v1/models/no-such-model", headers=live.headers())
    assert _err(r, 404)["code"] == "model_not_found"


def test_openapi_integer_bounds_are_exact(live):
    """seed's bounds are 64-bit integers in the document as in the model, not floats rounded to 2**63 (from which
    schemathesis generated 2**63 + 191 as a valid seed)."""
    from inferscale.engine.sampling import SEED_MAX, SEED_MIN

    text = httpx.get(live.url + "/openapi.json").text
    assert f'"maximum":{SEED_MAX}' in text.replace(" ", "") and "e+18" not in text
    seed = json.loads(text)["components"]["schemas"]["ChatCompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (SEED_MIN, SEED_MAX)
    assert all(type(v) is int for v in (seed["minimum"], seed["maximum"]))


def test_caller_values_are_400_and_configuration_is_500():
    """A bad value from the request is the caller's (400, with its param); a bad setting is the deployment's."""
    from inferscale.engine.sampling import Sampling
    from inferscale.errors import ConfigError, InvalidInputError
    from inferscale.server.httperrors import from_typed
    from inferscale.store.layout import check_name

    with pytest.raises(InvalidInputError) as bad_stop:
        Sampling(stop=("",))
    e = from_typed(bad_stop.value)
    assert (e.status, e.code, e.param) == (400, "invalid_value", "stop")
    with pytest.raises(InvalidInputError):
        check_name("user", "../etc")
    e = from_typed(ConfigError("KEK file /x: holds no key"))
    assert (e.status, e.type, e.code) == (500, "server_error", "configuration_error")
