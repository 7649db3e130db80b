"""One tenant against the others on a serving pod, through the real server on loopback (tests/server/conftest.py):
per-tenant budgets, per-user write ordering, bad input that used to 500, and what the API lets one tenant see of
the others' activity."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time

import httpx
import pytest

from server_live_fixtures import BUDGETS, MODEL


class SlowEmbedder:
    """The real embedder, slowed down, so a request is still encoding while a racing one arrives: it widens the
    race window the way a large upload on a busy pod does, without changing what is computed."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def embed(self, texts):
        time.sleep(self.delay_s)
        return self.inner.embed(texts)

    def embed_query(self, text, group):
        return self.inner.embed_query(text, group)


@contextlib.contextmanager
def slow_encoding(live, delay_s: float = 0.6):
    svc = live.app.state.memories
    inner = svc.embedder
    svc.embedder = SlowEmbedder(inner, delay_s)
    try:
        yield
    finally:
        svc.embedder = inner


def _items(prefix: str, n: int) -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": f"the user went to paris in may with her sister {i}"} for i in range(n)]


def _ids(live, tenant: str, user: str) -> set[str]:
    r = httpx.get(f"{live.url}/v1/memories/{user}", headers=live.headers(tenant), timeout=60)
    return set() if r.status_code == 404 else {i["id"] for i in r.json()["items"]}


def _in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_put_racing_delete_does_not_bring_deleted_memories_back(live):
    url, h = f"{live.url}/v1/memories/race-del", live.headers("acme")
    assert httpx.put(url, json={"items": _items("m", 6)}, headers=h, timeout=60).status_code == 200
    with slow_encoding(live):
        # Editing m0 re-encodes m1..m5 behind it; the DELETE arrives while that encoding runs.
        put, put_out = _in_thread(lambda: httpx.put(url, json={"items": [{"id": "m0", "text": "the user likes cats"}]},
                                                    headers=h, timeout=60))
        time.sleep(0.2)
        deleted = httpx.delete(url, headers=h, timeout=60)
        put.join(60)
    assert deleted.status_code == 200 and put_out[0].status_code == 200
    # One order or the other: PUT then DELETE (nothing left) or DELETE then PUT (only m0). Never m1..m5 again.
    assert _ids(live, "acme", "race-del") in (set(), {"m0"})


def test_replace_racing_a_put_encodes_nothing_behind_removed_memories(live):
    url, h = f"{live.url}/v1/memories/race-replace", live.headers("acme")
    assert httpx.put(url, json={"items": _items("old", 2)}, headers=h, timeout=60).status_code == 200
    with slow_encoding(live):
        rep, rep_out = _in_thread(lambda: httpx.put(url, json={"items": [{"id": "x", "text": "the user has a dog"}],
                                                               "replace": True}, headers=h, timeout=60))
        time.sleep(0.2)
        added = httpx.put(url, json={"items": [{"id": "y", "text": "the user has a cat"}]}, headers=h, timeout=60)
        rep.join(60)
    assert rep_out[0].status_code == 200 and added.status_code == 200
    assert _ids(live, "acme", "race-replace") == {"x", "y"}  # the acknowledged PUT is not lost
    store, fp = live.app.state.store, live.app.state.engine.loaded.fingerprint
    y = store.get_many("acme", "race-replace", ["y"], fp, copy=True)[0][0]
    assert y.extra["context"] == "x"  # encoded behind the list as it is, not behind the replaced old0, old1


def test_user_lock_map_is_empty_when_nobody_writes(live):
    assert len(live.app.state.memories.locks) == 0


def test_memory_count_budget_is_413_and_keeps_what_is_stored(live):
    url, h = f"{live.url}/v1/memories/u", live.headers("small")
    r = httpx.put(url, json={"items": _items("a", 4)}, headers=h, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "memory_limit_exceeded", r.text
    assert r.json()["error"]["param"] == "items"
    assert httpx.put(url, json={"items": _items("a", 2)}, headers=h, timeout=60).status_code == 200
    r = httpx.put(f"{live.url}/v1/memories/other", json={"items": _items("b", 2)}, headers=h, timeout=60)
    assert r.status_code == 413  # the budget is the tenant's, across its users
    assert _ids(live, "small", "u") == {"a0", "a1"}
    assert httpx.put(url, json={"items": _items("a", 2)}, headers=h, timeout=60).status_code == 200  # same ids


def test_encode_tokens_per_minute_is_429_with_retry_after(live):
    url, h = f"{live.url}/v1/memories/u", live.headers("slow")
    big = {"items": [{"id": "big", "text": " ".join(["paris"] * 400)}]}
    r = httpx.put(url, json=big, headers=h, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "encode_budget_exceeded", r.text
    part = {"items": [{"id": "p", "text": " ".join(["paris"] * 60)}]}
    assert httpx.put(url, json=part, headers=h, timeout=60).status_code == 200
    assert httpx.put(url, json=part, headers=h, timeout=60).status_code == 200
    r = httpx.put(url, json=part, headers=h, timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "encode_rate_exceeded", r.text
    assert int(r.headers["retry-after"]) >= 1
    assert _ids(live, "slow", "u") == {"p"}
    assert httpx.get(f"{live.url}/v1/models", headers=live.headers("acme")).status_code == 200


def test_disk_budget_is_413_before_the_disk_is_touched(live):
    r = httpx.put(f"{live.url}/v1/memories/u", json={"items": _items("d", 1)}, headers=live.headers("nodisk"),
                  timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "disk_quota_exceeded", r.text
    assert live.app.state.store.usage("nodisk") == (0, 0)


def test_each_tenants_dram_share_reaches_the_store(live):
    quotas = live.app.state.store.dram.tenant_quotas
    assert quotas["small"] == BUDGETS["small"]["dram_bytes"]
    assert quotas["acme"] is None  # the server default: no share below the whole budget


@pytest.mark.parametrize("where", ["message", "memory"])
def test_lone_surrogate_is_400_naming_the_field(live, where):
    if where == "message":
        path, body = "/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800"}]}' % MODEL
        named = "messages[0].content"
    else:
        path, body = "/v1/memories/sur", '{"items": [{"id": "s1", "text": "bad \\udc00 text"}]}'
        named = "items[0].text"
    method = "POST" if where == "message" else "PUT"
    r = httpx.request(method, live.url + path, content=body.encode(), timeout=60,
                      headers={**live.headers("fuzz"), "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"] and "surrogate" in r.json()["error"]["message"]


def test_full_disk_is_507_and_leaves_nothing_behind(live, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    r = httpx.put(f"{live.url}/v1/memories/full-disk", json={"items": _items("f", 1)}, headers=live.headers("acme"),
                  timeout=60)
    monkeypatch.undo()
    assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage", r.text
    assert _ids(live, "acme", "full-disk") == set()
    root = live.app.state.store.root / "acme" / "full-disk"
    assert not root.exists() or not [p for p in root.rglob("*") if p.is_file()]


def test_get_shows_no_tier(live):
    url, h = f"{live.url}/v1/memories/tierless", live.headers("acme")
    assert httpx.put(url, json={"items": _items("t", 1)}, headers=h, timeout=60).status_code == 200
    got = httpx.get(url, headers=h, timeout=60).json()["items"]
    assert got and all("tier" not in i for i in got)


def test_ttft_is_reported_coarsely(live):
    raw = live.client("acme").chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    header = float(raw.headers["x-inferscale-ttft-ms"])
    body = json.loads(raw.text)["inferscale"]["ttft_ms"]
    assert header > 0 and header % 10 == 0 and body % 10 == 0


def test_tenants_file_budgets_take_server_defaults_and_refuse_bad_values(tmp_path):
    from inferscale.errors import ConfigError
    from inferscale.server.auth import TenantRegistry, hash_key

    path = tmp_path / "tenants.json"
    budgets = {"max_memories": 7, "max_disk_bytes": 1 << 20, "dram_bytes": None, "encode_tokens_per_minute": 60}
    path.write_text(json.dumps({"a": [hash_key("k-a")], "b": {"keys": [hash_key("k-b")], "max_memories": 2,
                                                               "dram_bytes": 4096}}))
    reg = TenantRegistry(path, max_k=1, max_tokens=1, max_in_flight=1, budgets=budgets)
    a, b = reg.authenticate("k-a"), reg.authenticate("k-b")
    assert (a.max_memories, a.max_disk_bytes, a.dram_bytes, a.encode_tokens_per_minute) == (7, 1 << 20, None, 60)
    assert (b.max_memories, b.dram_bytes) == (2, 4096)
    assert a.take_encode_tokens(50) == 0.0 and a.take_encode_tokens(50) > 0  # 10 left, 40 more at 1 token/s
    path.write_text(json.dumps({"a": {"keys": [hash_key("k-a")], "max_disk_bytes": "lots"}}))
    with pytest.raises(ConfigError, match="max_disk_bytes"):
        TenantRegistry(path, max_k=1, max_tokens=1, max_in_flight=1, budgets=budgets)
