"""Issue 6, end to end: `kubectl apply` of a UserMemory -> operator -> encoding Job -> blocks on a serving pod ->
an `openai`-client chat request for that user in `kv` mode whose trace shows the injected blocks -> delete ->
blocks gone from every tier of the serving pod. The Job mounts no node directory: it delivers its sealed blobs to
the serving pod the operator chose, with an upload credential for its tenant and user only. With two tenants: a
second tenant's UserMemory for a user of the same id is encoded by its own Job, each tenant's key sees only its own
user, and deleting one leaves the other serving.

One test, two targets:
- local (always; CI): KMock emulator as API server, the real operator and server as local processes, and a node
  agent stand-in that plays kubelet for Jobs (see local_target.py / node_agent.py for what is simulated);
- real (always; CI): a real control plane started here (etcd, kube-apiserver, kube-controller-manager,
  kube-scheduler; real_target.py), the chart installed by `helm install`, the operator under its own
  ServiceAccount, kubelet stand-ins for the nodes;
- cluster (only when KUBECONFIG is set): `helm install` of charts/inferscale with values-cpu.yaml on that
  cluster, then the very same steps (cluster_target.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import yaml

from e2e_common import ROOT, internal_get, internal_request, kv_fetch_of_chat, wait_for

EXAMPLE = ROOT / "crds" / "examples" / "usermemory-inline.yaml"
# Tenant B's user has the same id as tenant A's, and other memories.
MEMORIES_B = [{"id": "g1", "text": "Caroline from Globex sells industrial widgets."},
              {"id": "g2", "text": "Caroline from Globex plays chess on Sundays."}]


@pytest.fixture(params=["local", "real", "cluster"])
def target(request, tmp_path_factory):
    if request.param == "real":
        from real_target import RealTarget

        # The Jobs in a namespace named by encoder.namespace; the fleet scenario keeps the chart's default
        # (<release namespace>-jobs). Either way each Job gets a Secret of its tenant's derived keys.
        t = RealTarget(tmp_path_factory.mktemp("e2e-real"), jobs_namespace="inferscale-jobs")
    elif request.param == "cluster":
        if not os.environ.get("KUBECONFIG"):
            pytest.skip("real-cluster target: KUBECONFIG is not set (point it at a cluster to helm-install "
                        "charts/inferscale there and run the same scenario)")
        from cluster_target import ClusterTarget

        t = ClusterTarget(tmp_path_factory.mktemp("e2e-cluster"))
    else:
        from local_target import LocalTarget

        t = LocalTarget(tmp_path_factory.mktemp("e2e-local"))
    try:
        t.start()
        yield t
    finally:
        t.close()


def _ready(obj):
    status = (obj or {}).get("status") or {}
    if status.get("phase") == "Failed":
        raise AssertionError(f"UserMemory failed: {status.get('message')}")
    return obj if status.get("phase") == "Ready" and status.get("observedGeneration") == obj["metadata"].get(
        "generation") else None


@pytest.mark.timeout(1800 if os.environ.get("KUBECONFIG") else 900)
def test_usermemory_end_to_end(target, tmp_path: Path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["namespace"] = target.tenant  # the namespace is the tenant
    doc["spec"]["model"] = target.model
    name, user = doc["metadata"]["name"], doc["spec"]["userId"]
    ids = sorted(m["id"] for m in doc["spec"]["memories"])
    manifest = tmp_path / "usermemory.yaml"
    manifest.write_text(yaml.safe_dump(doc, sort_keys=False))

    # 1. kubectl apply
    out = target.kubectl("apply", *target.apply_flags, "-f", str(manifest)).stdout
    assert f"usermemory.inferscale.io/{name}" in out

    # 2-4. operator -> encoding Job -> blocks pulled by a serving pod -> Ready, with the placement in the status
    um = wait_for(lambda: _ready(target.get_um(name)), target.ready_timeout, f"UserMemory {name} Ready", target.diag,
                  interval=0.5)
    status = um["status"]
    assert sorted(status["encoded"]) == ids
    assert status["job"]["phase"] == "Succeeded" and status["job"]["items"] == len(ids)
    assert status["counts"]["items"] == len(ids) and status["counts"]["tokens"] > 0
    assert len(status["placements"]) == 1, status["placements"]
    placement = status["placements"][0]
    assert placement["bytes"] > 0 and placement["tier"] in ("dram", "gpu")
    # The Job delivered to the pod that serves the user (its node is where the blobs are), mounting no node dir.
    assert status["job"]["node"] == placement["node"] and status["job"]["pod"].endswith("/" + placement["pod"])
    (job,) = [j for j in target.jobs() if j["metadata"]["name"] == status["job"]["name"]]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["inferscale", "encode"] and "--embed" in container["command"]
    assert "--deliver" in container["command"] and target.job_host_paths(job) == []
    url = target.endpoint(placement)
    tenant_headers = {"Authorization": f"Bearer {target.api_key}"}
    listed = httpx.get(f"{url}/v1/memories/{user}", headers=tenant_headers, timeout=30)
    assert listed.status_code == 200, listed.text
    assert sorted(i["id"] for i in listed.json()["items"]) == ids

    # 5. a chat request with the official openai client, this tenant's key, kv mode
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=target.api_key, max_retries=0, timeout=120)
    resp = client.chat.completions.create(
        model=target.model, user=user, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "What is Caroline researching?"}],
        extra_body={"inferscale": {"k": 5, "mode": "kv"}})
    assert resp.choices[0].finish_reason in ("stop", "length")
    meta = (resp.model_extra or {})["inferscale"]
    assert meta["mode"] == "kv" and sorted(meta["items"]) == ids and meta["memory_tokens"] > 0, meta
    # ... whose trace shows the injected blocks: chat > kv_fetch with the blocks and the tier they came from
    found = wait_for(lambda: kv_fetch_of_chat(target.spans(placement), target.tenant, user), 30,
                     "the chat's kv_fetch span in the server's trace output", target.diag)
    attrs = found["kv_fetch"]["attributes"]
    assert attrs["inferscale.kv.blocks"] == len(ids), attrs
    assert attrs["inferscale.kv.bytes"] > 0 and attrs["inferscale.kv.tier"] != "none", attrs
    assert found["chat"]["attributes"]["inferscale.retrieved"] == len(ids)

    # 5b. tenant B: its own UserMemory for a user of the same id, in its own namespace
    doc_b = {**doc, "metadata": {**doc["metadata"], "namespace": target.tenant_b},
             "spec": {**doc["spec"], "memories": MEMORIES_B}}
    manifest_b = tmp_path / "usermemory-b.yaml"
    manifest_b.write_text(yaml.safe_dump(doc_b, sort_keys=False))
    target.kubectl("apply", *target.apply_flags, "-f", str(manifest_b))
    um_b = wait_for(lambda: _ready(target.get_um(name, target.tenant_b)), target.ready_timeout,
                    f"UserMemory {target.tenant_b}/{name} Ready", target.diag, interval=0.5)
    ids_b = sorted(m["id"] for m in MEMORIES_B)
    # Every encode Job ran in the platform namespace (none in a tenant namespace), and no Job's pod saw any node
    # directory: each delivered, with a credential for its own tenant and user only.
    assert target.jobs(target.tenant) == [] and target.jobs(target.tenant_b) == []
    platform_jobs = {j["metadata"]["name"]: j for j in target.jobs()}
    assert target.job_host_paths(platform_jobs[um_b["status"]["job"]["name"]]) == []
    # Each tenant's key sees only its own user of that id.
    url_b = target.endpoint(um_b["status"]["placements"][0])
    b_headers = {"Authorization": f"Bearer {target.api_key_b}"}
    listed_b = httpx.get(f"{url_b}/v1/memories/{user}", headers=b_headers, timeout=30)
    assert listed_b.status_code == 200 and sorted(i["id"] for i in listed_b.json()["items"]) == ids_b, listed_b.text
    listed_a = httpx.get(f"{url}/v1/memories/{user}", headers=tenant_headers, timeout=30)
    assert sorted(i["id"] for i in listed_a.json()["items"]) == ids

    # 5c. a Job's upload credential reaches the serving pod's ingest route for its own tenant and user only; a
    # forged or expired one, or the internal token itself, stores nothing (401), another user's or tenant's is 403.
    _credential_checks(target, target.internal_endpoint(placement), user)

    # 6. delete: the finalizer purges every serving pod before the object goes
    target.kubectl("delete", "usermemories.inferscale.io", name, "-n", target.tenant, "--wait=false")
    wait_for(lambda: target.get_um(name) is None, target.gone_timeout, f"UserMemory {name} gone", target.diag,
             interval=0.5)

    # 7. blocks gone from every tier of the serving pod: API, DRAM/GPU accounting, disk tier files; tenant B untouched
    gone = httpx.get(f"{url}/v1/memories/{user}", headers=tenant_headers, timeout=30)
    assert gone.status_code == 404, gone.text
    assert target.store_blobs(placement, user) == []
    still_b = httpx.get(f"{url_b}/v1/memories/{user}", headers=b_headers, timeout=30)
    assert still_b.status_code == 200 and sorted(i["id"] for i in still_b.json()["items"]) == ids_b, still_b.text
    assert _ready(target.get_um(name, target.tenant_b))
    target.kubectl("delete", "usermemories.inferscale.io", name, "-n", target.tenant_b, "--wait=false")
    wait_for(lambda: target.get_um(name, target.tenant_b) is None, target.gone_timeout,
             f"UserMemory {target.tenant_b}/{name} gone", target.diag, interval=0.5)
    internal = {"Authorization": f"Bearer {target.internal_token}"}
    cap = internal_get(target, f"{target.internal_endpoint(placement)}/internal/v1/capacity", headers=internal,
                       timeout=30).json()
    assert cap["users"] == 0 and cap["bytes_used"] == 0, cap
    purged = [e for e in target.events() if e.get("reason") == "Purged"]
    assert purged and f"removed {len(ids)} block(s)" in purged[-1]["message"], purged


def _credential_checks(target, internal_url: str, user: str) -> None:
    import time

    from inferscale import uploadtoken

    key = uploadtoken.upload_key(target.internal_token)
    mine = uploadtoken.mint(key, target.tenant, user, "enc-x", 60)

    def post(tenant: str, who: str, token: str) -> httpx.Response:
        # over the fleet's TLS where the target has it (the internal API is HTTPS there)
        return internal_request(target, "POST", f"{internal_url}/internal/v1/ingest/{tenant}/{who}",
                                content=b"not a tar", headers={"Authorization": f"Bearer {token}"}, timeout=30)

    assert post(target.tenant, "someone-else", mine).status_code == 403
    assert post(target.tenant_b, user, mine).status_code == 403
    forged = uploadtoken.mint(uploadtoken.upload_key("not-the-token"), target.tenant, user, "enc-x", 60)
    expired = uploadtoken.mint(key, target.tenant, user, "enc-x", 60, now=time.time() - 3600)
    for token in (forged, expired, target.internal_token):
        assert post(target.tenant, user, token).status_code == 401, token
    assert post(target.tenant, user, mine).status_code == 400  # admitted; the body is no archive: nothing stored
