"""Issue 13, end to end on two nodes (two targets: local, fleet_target.py, on KMock; and real, real_target.py, on a
real control plane with the chart installed by helm): the encode Job runs on node 1, the
operator places the user there, and a request reaching the pod on node 2 (which holds nothing) is answered with
the memories, its blocks pulled from node 1 over NIXL UCX on demand; after an edit node 2 serves the new version,
not a stale one; after the delete no tier of either pod (nor the Job dir) holds a block, and a request is answered as a first
conversation (every peer says it holds nothing: no memory injected, and the answer reports items [] and 0 memory
tokens)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from e2e_common import ROOT, internal_get, kv_fetch_of_chat, wait_for

EXAMPLE = ROOT / "crds" / "examples" / "usermemory-inline.yaml"


@pytest.fixture(params=["local", "real"])
def fleet(request, tmp_path_factory):
    if request.param == "real":  # the real control plane, two kubelet stand-ins, the chart's DaemonSet
        from real_target import RealTarget

        t = RealTarget(tmp_path_factory.mktemp("e2e-fleet-real"), nodes=2)
    else:
        from fleet_target import FleetTarget

        t = FleetTarget(tmp_path_factory.mktemp("e2e-fleet"))
    try:
        t.start()
        yield t
    finally:
        t.close()


def _ready(obj, gen=None):
    status = (obj or {}).get("status") or {}
    if status.get("phase") == "Failed":
        raise AssertionError(f"UserMemory failed: {status.get('message')}")
    g = obj["metadata"].get("generation") if obj else None
    return obj if status.get("phase") == "Ready" and status.get("observedGeneration") == g \
        and (gen is None or g == gen) else None


def _ask(t, node, user, question="What is Caroline researching?"):
    from openai import OpenAI

    client = OpenAI(base_url=f"{t.node_url(node)}/v1", api_key=t.api_key, max_retries=0, timeout=120)
    return client.chat.completions.create(model=t.model, user=user, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": question}],
                                          extra_body={"inferscale": {"k": 5, "mode": "kv"}})


def _peer_fetch(t, node, user, after: int):
    """The newest kv_fetch of a kv chat for the user on `node`, once there are more than `after` chat spans."""
    spans = t.node_spans(node)
    chats = [s for s in spans if s["name"].startswith("chat ") and (s.get("attributes") or {}).get(
        "inferscale.user") == user]
    return kv_fetch_of_chat(spans, t.tenant, user) if len(chats) > after else None


@pytest.mark.timeout(900)
def test_any_pod_answers_any_user(fleet, tmp_path: Path):
    from fleet_target import NODE_2
    from local_target import NODE

    t = fleet
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["namespace"], doc["spec"]["model"] = t.tenant, t.model
    name, user = doc["metadata"]["name"], doc["spec"]["userId"]
    ids = sorted(m["id"] for m in doc["spec"]["memories"])
    manifest = tmp_path / "um.yaml"
    manifest.write_text(yaml.safe_dump(doc, sort_keys=False))
    t.kubectl("apply", *t.apply_flags, "-f", str(manifest))
    um = wait_for(lambda: _ready(t.get_um(name)), t.ready_timeout, "Ready", t.diag, interval=0.5)
    assert um["status"]["job"]["node"] == NODE
    assert [p["node"] for p in um["status"]["placements"]] == [NODE], um["status"]["placements"]
    internal = {"Authorization": f"Bearer {t.internal_token}"}
    # The operator published node 1's peer address (podIP + NIXL port) to node 2; no annotation named it.
    wait_for(lambda: internal_get(t, f"{t.node_internal(NODE_2)}/internal/v1/peers", headers=internal).json()[
        "peers"] == [f"127.0.0.2:{t.nixl_port}"], 30, "node 2's peers", t.diag)
    assert t.node_blobs(NODE_2, user) == []  # node 2 holds nothing yet

    # 1. the request lands on node 2: blocks pulled from node 1 over UCX, answered with the memories
    resp = _ask(t, NODE_2, user)
    meta = resp.model_extra["inferscale"]
    assert meta["mode"] == "kv" and sorted(meta["items"]) == ids and meta["memory_tokens"] > 0, meta
    found = wait_for(lambda: _peer_fetch(t, NODE_2, user, 0), 30, "node 2's kv_fetch span", t.diag)
    attrs = found["kv_fetch"]["attributes"]
    assert "peer" in attrs["inferscale.kv.tier"] and attrs["inferscale.kv.peer_bytes"] > 0, attrs
    assert attrs["inferscale.kv.blocks.peer"] == len(ids), attrs

    # 2. edit: m3 removed, m4 added; node 2 serves the new version (refetched), never the stale one
    doc["spec"]["memories"] = [m for m in doc["spec"]["memories"] if m["id"] != "m3"] + [
        {"id": "m4", "text": "Caroline adopted a dog named Rex."}]
    manifest.write_text(yaml.safe_dump(doc, sort_keys=False))
    t.kubectl("apply", *t.apply_flags, "-f", str(manifest))
    wait_for(lambda: _ready(t.get_um(name), 2), t.ready_timeout, "Ready at generation 2", t.diag, interval=0.5)
    resp = _ask(t, NODE_2, user, "Did Caroline adopt a dog?")
    assert sorted(resp.model_extra["inferscale"]["items"]) == ["m1", "m2", "m4"], resp.model_extra
    again = wait_for(lambda: _peer_fetch(t, NODE_2, user, 1), 30, "node 2's second kv_fetch", t.diag)
    assert "peer" in again["kv_fetch"]["attributes"]["inferscale.kv.tier"]  # refetched, not served stale
    assert not [b for b in t.node_blobs(NODE, user) if "m3" in Path(b).name]  # m3 left node 1's store too

    # 3. delete: nothing left in any tier of either pod; a request is answered as a first
    #    conversation: every peer says it holds nothing, so no memory is injected (and the answer says so)
    t.kubectl("delete", "usermemories.inferscale.io", name, "-n", t.tenant, "--wait=false")
    wait_for(lambda: t.get_um(name) is None, t.gone_timeout, "UserMemory gone", t.diag, interval=0.5)
    for node in (NODE, NODE_2):
        cap = internal_get(t, f"{t.node_internal(node)}/internal/v1/capacity", headers=internal).json()
        assert cap["users"] == 0 and cap["bytes_used"] == 0, (node, cap)
        assert t.node_blobs(node, user) == [], node
        r = httpx.post(f"{t.node_url(node)}/v1/chat/completions", headers={"Authorization": f"Bearer {t.api_key}"},
                       json={"model": t.model, "user": user, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}], "inferscale": {"k": 5, "mode": "kv"}},
                       timeout=60)
        assert r.status_code == 200, (node, r.status_code, r.text)
        assert r.json()["inferscale"]["items"] == [] and r.json()["inferscale"]["memory_tokens"] == 0, r.text
