"""Tenancy: the key decides the tenant; other tenants' users are invisible (404, no data); limits answer 400, the
in-flight cap 429."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import KEYS, MODEL

Q = [{"role": "user", "content": "where did caroline move?"}]


def test_wrong_or_missing_key_is_401(live):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}):
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/memories/caroline"),
                             ("POST", "/v1/chat/completions")):
            r = httpx.request(method, live.url + path, headers=headers, json={"model": MODEL, "messages": Q})
            assert r.status_code == 401, (method, path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_other_tenants_user_is_404_and_no_data(engine_live, engine_memories):
    # caroline belongs to acme; globex asks for her.
    h = engine_live.headers("globex")
    r = httpx.get(f"{engine_live.url}/v1/memories/caroline", headers=h)
    assert r.status_code == 404 and "caroline" not in r.json().get("items", "")
    assert "support group" not in r.text
    assert httpx.delete(f"{engine_live.url}/v1/memories/caroline", headers=h).status_code == 404
    assert httpx.delete(f"{engine_live.url}/v1/memories/caroline/m1", headers=h).status_code == 404
    # Chat answers as for any user without memories yet: none of hers are injected.
    r = engine_live.client("globex").chat.completions.create(model=MODEL, user="caroline", messages=Q,
                                                      extra_body={"inferscale": {"k": 3}})
    assert r.model_extra["inferscale"]["items"] == [] and r.model_extra["inferscale"]["memory_tokens"] == 0
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # ...and acme still has her, untouched.
    assert len(httpx.get(f"{engine_live.url}/v1/memories/caroline", headers=engine_live.headers("acme")).json()["items"]) == 5


def test_same_user_id_in_two_tenants_is_two_users(engine_live):
    for tenant, text in (("acme", "the user likes paris"), ("globex", "the user likes london")):
        r = httpx.put(f"{engine_live.url}/v1/memories/shared-id", json={"items": [{"id": "x", "text": text}]},
                      headers=engine_live.headers(tenant))
        assert r.status_code == 200
    for tenant, text in (("acme", "paris"), ("globex", "london")):
        items = httpx.get(f"{engine_live.url}/v1/memories/shared-id", headers=engine_live.headers(tenant)).json()["items"]
        assert [i["text"] for i in items] == [f"the user likes {text}"]
    httpx.delete(f"{engine_live.url}/v1/memories/shared-id", headers=engine_live.headers("globex"))
    assert httpx.get(f"{engine_live.url}/v1/memories/shared-id", headers=engine_live.headers("acme")).status_code == 200


def test_limits_are_400(engine_live):
    """Over a tenant's limit is a bad request (the SDK would retry a 429 for nothing); 429 is for rate only."""
    c = engine_live.client("tight")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=Q, extra_body={"inferscale": {"k": 4}})
    assert e.value.body["code"] == "k_limit_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=Q, max_tokens=9)
    assert c.chat.completions.create(model=MODEL, messages=Q, max_tokens=8).choices


def test_in_flight_limit_is_429(live):
    """tight allows one request in flight: while a stream is open, a second request is refused."""
    c = live.client("tight")
    stream = c.chat.completions.create(model=MODEL, messages=Q, stream=True, max_tokens=8)
    first = next(iter(stream))  # the request is in flight until the stream ends
    assert first.choices[0].delta.role == "assistant"
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model=MODEL, messages=Q, max_tokens=2)
    assert e.value.body["code"] == "rate_limit_exceeded"
    list(stream)
    stream.close()
    assert c.chat.completions.create(model=MODEL, messages=Q, max_tokens=2).choices


@pytest.mark.parametrize("stream", [True, False])
def test_a_tenants_slots_are_free_once_the_client_has_read_the_end(live, stream, monkeypatch):
    """tight allows one request in flight: when the client has read the end of an answer ([DONE], or the whole
    JSON), its in-flight slots (the guard's and the engine's) are free, so a next request sent at once is not refused
    429: they were given back after the last bytes went out, and a CI run's test_in_flight_limit_is_429 met one."""
    import asyncio

    from inferscale.server.guard import TenantGuard

    unhurried = TenantGuard._filter

    def slow(self, send, *args):  # the server's loop gets to the rest a while after handing each piece of body on
        inner = unhurried(self, send, *args)

        async def send_then_wait(msg):
            await inner(msg)
            if msg["type"] == "http.response.body":
                await asyncio.sleep(0.05)
        return send_then_wait

    monkeypatch.setattr(TenantGuard, "_filter", slow)
    c = live.client("tight")
    tight = live.app.state.tenants.authenticate(KEYS["tight"])
    for _ in range(3):
        if stream:
            for _chunk in c.chat.completions.create(model=MODEL, messages=Q, stream=True, max_tokens=2):
                pass
        else:
            c.chat.completions.create(model=MODEL, messages=Q, max_tokens=1)
        assert (tight.requests, tight.in_flight) == (0, 0)
