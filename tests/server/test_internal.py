"""The operator's internal API: pull from a node-local dir, purge from every tier, capacity."""

from __future__ import annotations

import shutil

import httpx

from inferscale.engine.template import MemoryItem
from inferscale.kvformat import SUFFIX, save_block

INTERNAL = {"Authorization": "Bearer internal-secret"}


def test_internal_needs_token(live):
    for h in ({}, {"Authorization": "Bearer isk-acme-key"}):
        assert httpx.get(live.internal_url + "/internal/v1/capacity", headers=h).status_code == 401


def test_pull_purge_capacity(live, tiny_engine, embedder):
    items = [MemoryItem("p1", "melanie plays with her dog"), MemoryItem("p2", "melanie lives in london")]
    src = live.settings.kv_host_path / "globex" / "melanie"
    for b in tiny_engine.encode(items, embed=embedder.embed):
        save_block(b, src)
    body = {"tenant": "globex", "user": "melanie", "source": {"node": "node-a", "dir": str(src), "peer": None},
            "items": None}
    for _ in range(2):  # idempotent
        r = httpx.post(live.internal_url + "/internal/v1/pull", json=body, headers=INTERNAL)
        assert r.status_code == 200, r.text
        assert r.json()["blocks"] == 2 and r.json()["bytes"] > 0 and r.json()["tier"] == "dram"
        assert r.json()["tokens"] > 0
    # Pulling one item again still answers the user's totals.
    r = httpx.post(live.internal_url + "/internal/v1/pull", json={**body, "items": ["p1"]}, headers=INTERNAL)
    assert r.status_code == 200 and r.json()["blocks"] == 2
    g = live.client("globex").chat.completions.create(model="gemma-3-270m", user="melanie", max_tokens=3,
                                                      messages=[{"role": "user", "content": "where does she live?"}])
    assert g.model_extra["inferscale"]["items"]
    cap = httpx.get(live.internal_url + "/internal/v1/capacity", headers=INTERNAL).json()
    assert cap["node"] == "node-a" and cap["pod"] == "pod-a" and cap["users"] >= 1
    r = httpx.post(live.internal_url + "/internal/v1/purge", json={"tenant": "globex", "user": "melanie", "items": ["p1"]},
                   headers=INTERNAL)
    assert r.json()["removed_blocks"] == 1
    r = httpx.post(live.internal_url + "/internal/v1/purge", json={"tenant": "globex", "user": "melanie", "items": None},
                   headers=INTERNAL)
    assert r.json()["removed_blocks"] == 1
    r = httpx.post(live.internal_url + "/internal/v1/purge", json={"tenant": "globex", "user": "melanie", "items": None},
                   headers=INTERNAL)
    assert r.json() == {"removed_blocks": 0, "removed_bytes": 0}
    assert httpx.get(live.url + "/v1/memories/melanie", headers=live.headers("globex")).status_code == 404
    shutil.rmtree(src)


def _purge(live, **body):
    return httpx.post(live.internal_url + "/internal/v1/purge", json={"tenant": "globex", "user": "melanie", "items": None,
                                                             **body}, headers=INTERNAL)


def test_purge_deletes_the_jobs_output_dir(live, tiny_engine, embedder):
    root = live.settings.kv_host_path
    src = root / "globex" / "melanie"
    src.mkdir(parents=True)
    for b in tiny_engine.encode([MemoryItem("d1", "melanie sings")], embed=embedder.embed):
        save_block(b, src)
    body = {"tenant": "globex", "user": "melanie", "source": {"node": "node-a", "dir": str(src), "peer": None},
            "items": None}
    assert httpx.post(live.internal_url + "/internal/v1/pull", json=body, headers=INTERNAL).status_code == 200
    (src / "stray.tmp").write_text("half-written")
    r = _purge(live, source_dir=str(src) + "/")
    assert r.status_code == 200, r.text
    assert r.json() == {"removed_blocks": 1, "removed_bytes": r.json()["removed_bytes"], "source_dir_removed": True}
    assert not src.exists() and (root / "globex").is_dir()
    # Idempotent: nothing left to remove.
    assert _purge(live, source_dir=str(src)).json() == {"removed_blocks": 0, "removed_bytes": 0,
                                                        "source_dir_removed": False}


def test_purge_refuses_a_source_dir_outside_the_users_dir(live, tmp_path):
    root = live.settings.kv_host_path
    (root / "globex" / "other").mkdir(parents=True, exist_ok=True)
    outside = tmp_path / "globex" / "melanie"
    outside.mkdir(parents=True)
    (root / "globex" / "link").symlink_to(tmp_path / "globex")  # <root>/globex/link/melanie resolves outside
    for bad in [
        str(root / "globex" / "other"),                    # another user
        str(root / "acme" / "melanie"),                    # another tenant
        str(root / "globex"),                              # the tenant dir
        str(root),                                         # the root itself
        str(root / "globex" / "melanie" / ".." / "other"),  # traversal
        str(root / ".." / "globex" / "melanie"),           # traversal out of the root
        "globex/melanie",                                  # relative
        str(outside),                                      # right names, outside the root
        str(root / "globex" / "link" / "melanie"),         # inside by name, outside once resolved
        str(root / "x" / "globex" / "melanie") + "/./",
    ]:
        r = _purge(live, source_dir=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "source_dir"
    assert (root / "globex" / "other").is_dir() and outside.is_dir()
    assert "must end in /globex/melanie" in _purge(live, source_dir="/").json()["error"]["message"]  # not "normalized"


def test_peers_are_set_by_the_operator_only(live):
    url = live.internal_url + "/internal/v1/peers"
    body = {"peers": ["10.0.0.7:5555", "10.0.0.8:5555"]}
    for h in ({}, {"Authorization": "Bearer isk-acme-key"}):  # a tenant key never works on the internal plane
        assert httpx.put(url, json=body, headers=h).status_code == 401
    # ... and the tenant port does not serve it at all
    assert httpx.put(live.url + "/internal/v1/peers", json=body, headers=live.headers("acme")).status_code == 404
    r = httpx.put(url, json=body, headers=INTERNAL)
    assert r.status_code == 200 and r.json() == body
    assert httpx.get(url, headers=INTERNAL).json() == body
    assert httpx.put(url, json={"peers": ["no-port"]}, headers=INTERNAL).status_code == 400
    assert httpx.get(url, headers=INTERNAL).json() == body  # a refused list changes nothing
    assert httpx.put(url, json={"peers": []}, headers=INTERNAL).json() == {"peers": []}


def test_purge_of_items_removes_only_their_blobs_from_the_job_dir(live, tiny_engine, embedder):
    src = live.settings.kv_host_path / "globex" / "melanie"
    src.mkdir(parents=True, exist_ok=True)
    items = [MemoryItem("e1", "melanie sings"), MemoryItem("e2", "melanie paints")]
    for b in tiny_engine.encode(items, embed=embedder.embed):
        save_block(b, src)
    r = _purge(live, source_dir=str(src), items=["e1"])
    assert r.status_code == 200 and r.json()["source_dir_removed"] is True
    assert sorted(p.name for p in src.iterdir()) == [f"e2{SUFFIX}"]
    shutil.rmtree(src)
