"""The memories API over a store that seals its blobs (as every server's does): what it reads back about stored
memories (text for GET and for re-encoding, each block's context for a delete) comes from the opened blob, not
from a plain header that a sealed file no longer has. Otherwise a deleted memory lives on in the KV of the
memories encoded behind it."""

from __future__ import annotations

import httpx

from .test_sealing import live_server  # noqa: F401  (the fixture: a server that opens its own sealed store)


def test_delete_and_edit_over_sealed_blobs(live_server):  # noqa: F811
    url, app, _, key = live_server
    h = {"Authorization": f"Bearer {key}"}
    items = [{"id": f"m{i}", "text": f"the user went to paris with her sister {i}"} for i in range(4)]
    assert httpx.put(f"{url}/v1/memories/dora", json={"items": items}, headers=h, timeout=120).status_code == 200
    got = httpx.get(f"{url}/v1/memories/dora", headers=h, timeout=60).json()["items"]
    assert {i["id"]: i["text"] for i in got} == {i["id"]: i["text"] for i in items}
    r = httpx.delete(f"{url}/v1/memories/dora/m1", headers=h, timeout=120)
    assert r.status_code == 200, r.text
    store, fp = app.state.store, app.state.engine.loaded.fingerprint
    behind = store.get_many("acme", "dora", ["m2", "m3"], fp, copy=True)[0]
    assert all("m1" not in b.extra["context"].split(",") for b in behind)  # re-encoded without the deleted one
    r = httpx.put(f"{url}/v1/memories/dora", json={"items": [{"id": "m0", "text": "the user likes cats"}]},
                  headers=h, timeout=120)
    assert r.status_code == 200, r.text  # m2, m3 are encoded again behind the edit: their text is read back
    m2 = store.get_many("acme", "dora", ["m2"], fp, copy=True)[0][0]
    assert m2.text == items[2]["text"] and m2.extra["context"] == "m0"
