"""The OpenAI client against a live server: non-stream and stream, with memories; models; health; memories API."""

from __future__ import annotations

import httpx

from conftest import MODEL


def test_models_and_health(engine_live):
    models = engine_live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(engine_live.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(engine_live.url + "/readyz").json() == {"status": "ready"}  # no load figures (issue 20)
    m = engine_live.scrape()
    # /v1/models above was recorded by the HTTP instrumentation (GenAI histograms appear after a chat: test_otel.py).
    assert m.status_code == 200 and 'http_route="/v1/models"' in m.text


def test_chat_non_stream_with_memories(engine_live, engine_memories):
    client = engine_live.client()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, user="caroline", max_tokens=6,
        messages=[{"role": "user", "content": "where did caroline move?"}],
        extra_body={"inferscale": {"k": 3, "mode": "kv"}},
    )
    assert float(raw.headers["x-inferscale-ttft-ms"]) > 0
    resp = raw.parse()
    assert resp.object == "chat.completion"
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.usage.completion_tokens <= 6
    ext = resp.model_extra["inferscale"]
    assert ext["mode"] == "kv" and len(ext["items"]) == 3 and "m3" in ext["items"]
    assert ext["memory_tokens"] > 0


def test_chat_stream_with_memories(engine_live, engine_memories):
    client = engine_live.client()
    for mode in engine_live.app.state.modes:  # kv-recompute only once the engine ships it
        stream = client.chat.completions.create(
            model=MODEL, user="caroline", max_tokens=5, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "who went camping?"}],
            extra_body={"inferscale": {"k": 2, "mode": mode}},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes and finishes[-1] in ("stop", "length")
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 5


def test_same_answer_stream_and_not(engine_live, engine_memories):
    client = engine_live.client()
    kw = dict(model=MODEL, user="caroline", max_tokens=6, messages=[{"role": "user", "content": "who painted the beach?"}],
              extra_body={"inferscale": {"k": 2}})
    full = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices)
    assert full == streamed.strip()


def test_memories_crud(live):
    h = live.headers("acme")
    items = [{"id": "a1", "text": "the user likes paris"}, {"id": "a2", "text": "the user has a cat"}]
    r = httpx.put(f"{live.url}/v1/memories/crud-user", json={"items": items}, headers=h)
    assert r.status_code == 200 and r.json()["encoded"] == 2
    got = httpx.get(f"{live.url}/v1/memories/crud-user", headers=h).json()
    assert sorted(i["id"] for i in got["items"]) == ["a1", "a2"]
    r = httpx.delete(f"{live.url}/v1/memories/crud-user/a1", headers=h)
    assert r.status_code == 200 and r.json()["removed_blocks"] == 1
    assert httpx.delete(f"{live.url}/v1/memories/crud-user/a1", headers=h).status_code == 404
    r = httpx.put(f"{live.url}/v1/memories/crud-user", json={"items": [{"id": "a3", "text": "x y"}], "replace": True}, headers=h)
    assert r.json()["removed"] == 1
    assert [i["id"] for i in httpx.get(f"{live.url}/v1/memories/crud-user", headers=h).json()["items"]] == ["a3"]
    assert httpx.delete(f"{live.url}/v1/memories/crud-user", headers=h).json()["removed_blocks"] == 1
    assert httpx.get(f"{live.url}/v1/memories/crud-user", headers=h).status_code == 404


def test_new_memories_are_encoded_behind_the_latest_stored_ones(live, tiny_engine):
    """An upload continues the user's list: its first item's context is the user's latest stored memories, so a
    memory added later gets the same KV as if the whole list had been uploaded at once."""
    h = live.headers("acme")
    first = [{"id": "c1", "text": "the user moved to oslo"}, {"id": "c2", "text": "the user adopted a dog"}]
    later = [{"id": "c3", "text": "the user started running"}]
    url = f"{live.url}/v1/memories/context-user"
    assert httpx.put(url, json={"items": first}, headers=h).status_code == 200
    assert httpx.put(url, json={"items": later}, headers=h).status_code == 200
    store, fp = live.app.state.memories.store, tiny_engine.loaded.fingerprint
    stored = store.get_many("acme", "context-user", ["c3"], fp, copy=True)[0][0]
    from inferscale.engine import MemoryItem

    whole = tiny_engine.encode([MemoryItem(**i) for i in first + later])[2]
    assert stored.extra["context"] == "c1,c2" and stored.start_pos == whole.start_pos
    assert (stored.kv.float() - whole.kv.float()).abs().max() < 1e-4
    # replace=True starts the list over: nothing stored before is context any more
    httpx.put(url, json={"items": later, "replace": True}, headers=h)
    assert store.get_many("acme", "context-user", ["c3"], fp, copy=True)[0][0].extra["context"] == ""
    httpx.delete(url, headers=h)


def test_replacing_or_deleting_a_memory_reencodes_the_ones_behind_it(live, tiny_engine):
    """Blocks carry their context's text in their KV: after an edit or a delete the memories encoded behind it are
    encoded again, so what a user deleted does not live on in other memories, and the list keeps its order."""
    from inferscale.engine import MemoryItem

    h = live.headers("acme")
    url = f"{live.url}/v1/memories/edit-user"
    items = [{"id": f"e{i}", "text": f"the user fact number {i}"} for i in range(4)]
    assert httpx.put(url, json={"items": items}, headers=h).status_code == 200
    store, fp = live.app.state.memories.store, tiny_engine.loaded.fingerprint

    def block(i):
        return store.get_many("acme", "edit-user", [i], fp, copy=True)[0][0]

    edited = {"id": "e1", "text": "the user moved to lima"}
    assert httpx.put(url, json={"items": [edited]}, headers=h).status_code == 200
    want = tiny_engine.encode([MemoryItem(**i) for i in [items[0], edited, items[2], items[3]]])
    for b in want:  # e1 kept its place; e2 and e3 were encoded again behind the new text
        assert (block(b.item_id).kv.float() - b.kv.float()).abs().max() < 1e-4, b.item_id
    assert [i["id"] for i in httpx.get(url, headers=h).json()["items"]] == ["e0", "e1", "e2", "e3"]

    assert httpx.delete(f"{url}/e1", headers=h).status_code == 200
    want = tiny_engine.encode([MemoryItem(**i) for i in [items[0], items[2], items[3]]])
    for b in want:
        got = block(b.item_id)
        assert "e1" not in got.extra["context"].split(",")
        assert (got.kv.float() - b.kv.float()).abs().max() < 1e-4, b.item_id
    httpx.delete(url, headers=h)


def test_a_large_upload_is_encoded_in_chunks_once_each(live, tiny_engine, monkeypatch):
    """More items than one engine call takes: chunk boundaries change nothing, and no item is encoded twice."""
    from inferscale.engine import MemoryItem
    from inferscale.memories import ENCODE_CHUNK

    items = [{"id": f"b{i:02d}", "text": f"the user remembers thing {i}"} for i in range(ENCODE_CHUNK + 6)]
    encoded: list[str] = []
    real = tiny_engine.encode

    def spy(*args, **kwargs):
        blocks = real(*args, **kwargs)
        encoded.extend(b.item_id for b in blocks)
        return blocks

    monkeypatch.setattr(tiny_engine, "encode", spy)
    url = f"{live.url}/v1/memories/bulk-user"
    assert httpx.put(url, json={"items": items}, headers=live.headers("acme")).status_code == 200
    monkeypatch.setattr(tiny_engine, "encode", real)
    assert sorted(encoded) == [i["id"] for i in items]
    store, fp = live.app.state.memories.store, tiny_engine.loaded.fingerprint
    want = tiny_engine.encode([MemoryItem(**i) for i in items])
    got = store.get_many("acme", "bulk-user", [b.item_id for b in want], fp, copy=True)[0]
    for a, b in zip(got, want):
        assert a.extra["context"] == b.extra["context"] and (a.kv.float() - b.kv.float()).abs().max() < 1e-4
    httpx.delete(url, headers=live.headers("acme"))
