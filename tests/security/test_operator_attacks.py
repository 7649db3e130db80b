"""Attack matrix, cluster side (issue 11): what a tenant can do with the objects it may write, against the real operator.

Each test plays one attack from a tenant's seat (it writes only UserMemory objects, their status, and ConfigMaps/
Secrets/Jobs/pods in its own namespace) and asserts the operator does not act on it. KMock stands in for the API
server (it evaluates no CEL: the CRD rules are checked in test_crd_id_rules.py); stand-ins play the serving pods.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from typing import Any

import pytest

from security.operator_harness import JOB_NS, TENANT, Cluster, cluster, operator, running_operator, standins, wait_for  # noqa: F401
from operator_fakes import ServingPodStandIn

MEMORIES = [{"id": "m1", "text": "Caroline went to a support group."}, {"id": "m2", "text": "Caroline paints."}]


def user_memory(name: str, user: str, ns: str = TENANT, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "inferscale.io/v1alpha1", "kind": "UserMemory", "metadata": {"name": name, "namespace": ns},
            "spec": {"userId": user, "model": "gemma-3-270m", "memories": MEMORIES, "placement": {"replicas": 1},
                     **spec}}


def all_jobs(cluster: Cluster) -> list[dict[str, Any]]:
    return cluster.list("/apis/batch/v1/jobs")


def jobs_for(cluster: Cluster, cr_name: str) -> list[dict[str, Any]]:
    return [j for j in all_jobs(cluster) if (j["metadata"].get("labels") or {}).get("inferscale.io/usermemory") == cr_name
            or j["metadata"]["name"].startswith((f"{cr_name}-", f"{TENANT}-{cr_name}-"))]


def reason_is(cluster: Cluster, name: str, reason: str, ns: str = TENANT) -> Any:
    def check() -> Any:
        st = cluster.status(name, ns)
        return st.get("phase") == "Failed" and any(c.get("reason") == reason for c in st.get("conditions") or []) and st
    return check


def ready_caroline(cluster: Cluster, standins: list[ServingPodStandIn], node: str = "node-1") -> dict[str, Any]:
    for s in standins:
        cluster.add_serving_pod(s)
    cluster.apply_um(user_memory("caroline", "caroline"))
    # Wherever the Job is (the first test pins that down): the attacks below must fail on their own merits.
    job = wait_for(lambda: jobs_for(cluster, "caroline"), what="caroline's encode Job")[0]
    cluster.finish_job(job, node=node)
    return wait_for(lambda: (st := cluster.status("caroline")).get("phase") == "Ready" and st, what="Ready")


def secret_requests(cluster: Cluster) -> int:
    return cluster.emu.call(lambda: sum(1 for r in cluster.emu.emulator
                                        if r.resource is not None and r.resource.plural == "secrets"))


# -- item 1: encoding runs where the platform owns it --------------------------------------------------------------
def test_encode_job_runs_in_the_platform_namespace_and_mounts_no_node_directory(
        cluster: Cluster, standins: list[ServingPodStandIn], operator: Any) -> None:
    cluster.apply_um(user_memory("caroline", "caroline"))
    job = wait_for(lambda: all_jobs(cluster), what="an encode Job")[0]
    assert job["metadata"]["namespace"] == JOB_NS and cluster.jobs(TENANT) == []
    pod = job["spec"]["template"]["spec"]
    (encode,) = pod["containers"]
    # Pod Security `restricted` (issue 24 #1): no hostPath, no root init container; it delivers instead.
    assert not [v for v in pod["volumes"] if "hostPath" in v] and not pod.get("initContainers")
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod.get("automountServiceAccountToken") is False and not pod.get("hostNetwork")
    sc = encode["securityContext"]
    assert sc["runAsNonRoot"] and sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and not sc.get("privileged")
    assert encode["resources"]["requests"] and encode["resources"]["limits"]
    assert job["spec"]["activeDeadlineSeconds"] > 0
    assert cluster.list(f"/api/v1/namespaces/{TENANT}/configmaps") == [], "nothing is created in the tenant namespace"


# -- item 5: the operator's reach -----------------------------------------------------------------------------------
def test_no_secret_is_read_on_a_tenants_behalf(cluster: Cluster, standins: list[ServingPodStandIn],
                                               operator: Any) -> None:
    cluster.create(f"/api/v1/namespaces/{TENANT}/secrets", {"metadata": {"name": "other-app", "namespace": TENANT},
                   "data": {"k": base64.b64encode(b'{"id": "s1", "text": "db password hunter2"}').decode()}})
    before = secret_requests(cluster)
    cluster.apply_um(user_memory("caroline", "caroline", memoriesFrom={"secretKeyRef": {"name": "other-app",
                                                                                         "key": "k"}}))
    st = wait_for(reason_is(cluster, "caroline", "SecretsNotEnabled"), what="Failed SecretsNotEnabled")
    assert "INFERSCALE_READ_TENANT_SECRETS" in st["message"]
    assert secret_requests(cluster) == before, "the operator must not even read the Secret"
    assert all_jobs(cluster) == []


@pytest.mark.parametrize("namespace", ["initech", "kube-system", "default", JOB_NS])
def test_a_namespace_outside_the_allow_list_is_never_served(cluster: Cluster, standins: list[ServingPodStandIn],
                                                           operator: Any, namespace: str) -> None:
    cluster.apply_um(user_memory("intruder", "caroline", ns=namespace))
    cluster.apply_um(user_memory("control", "someone"))  # an allowed tenant: proves the operator is running
    wait_for(lambda: jobs_for(cluster, "control"), what="the control object's Job")
    time.sleep(2.5)  # a few recheck periods (INFERSCALE_RECHECK_SECONDS=1)
    assert jobs_for(cluster, "intruder") == []
    obj = cluster.um("intruder", namespace)
    assert obj is not None and not obj["metadata"].get("finalizers") and not obj.get("status")


def test_a_forged_node_in_status_starts_no_job_on_it(cluster: Cluster, standins: list[ServingPodStandIn],
                                                      operator: Any) -> None:
    cluster.create("/api/v1/nodes", {"metadata": {"name": "victim-node", "labels": {
        "kubernetes.io/hostname": "victim-node"}}})
    ready_caroline(cluster, standins, node="node-1")
    # The tenant rewrites the status it may write: every item (and the last Job) "ran" on the victim node.
    forged = {"encoded": {"m1": {"node": "victim-node"}, "m2": {"node": "victim-node"}},
              "job": {"node": "victim-node"}}
    cluster.patch(cluster.um_path("caroline") + "/status", {"status": forged})
    cluster.delete(cluster.um_path("caroline"))
    wait_for(lambda: cluster.um("caroline") is None, what="the object to be gone")
    assert not [j for j in all_jobs(cluster) if j["spec"]["template"]["spec"].get("nodeName") == "victim-node"]
    assert not any(s.held(TENANT, "caroline") for s in standins), "purged from the serving pods' stores"


def test_a_forged_node_in_status_does_not_pick_the_pull_source(cluster: Cluster, standins: list[ServingPodStandIn],
                                                              operator: Any) -> None:
    real = ready_caroline(cluster, standins, node="node-1")["job"]["node"]  # where the Job delivered
    placed = cluster.status("caroline")["placements"][0]["pod"]
    cluster.patch(cluster.um_path("caroline") + "/status",
                  {"status": {"encoded": {"m1": {"node": "evil-node"}, "m2": {"node": "evil-node"}}}})
    # The serving pod holding the user goes: the recheck timer re-places on the other one, which must pull from
    # where the operator's record says the blobs went.
    cluster.delete(f"/api/v1/namespaces/{JOB_NS}/pods/{placed}")
    other = next(s for s in standins if s.pod != placed)
    pull = wait_for(lambda: other.calls_of("pull"), what="the re-placement's pull")[-1]
    assert pull["source"]["node"] == real != "evil-node", pull


def _old_style_job_name(cr_name: str) -> str:
    """The encode Job name the starting code derived from public data only (the spec)."""
    from inferscale.operator.spec import parse

    desired = parse(user_memory(cr_name, cr_name)["spec"], ("gemma-3-270m",), lambda *a: "")
    digest = hashlib.sha256(json.dumps([desired.content_hash(), sorted(desired.items)]).encode()).hexdigest()[:10]
    return f"{cr_name}-enc-{digest}"


def _complete_job(cluster: Cluster, ns: str, name: str, labels: dict[str, str] | None = None) -> None:
    cluster.create(f"/apis/batch/v1/namespaces/{ns}/jobs", {
        "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "nodeName": "evil-node",
                                       "containers": [{"name": "encode", "image": "evil"}]}}}})
    cluster.patch(f"/apis/batch/v1/namespaces/{ns}/jobs/{name}/status",
                  {"status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}})


def test_a_pre_created_job_is_not_taken_as_the_encoding(cluster: Cluster, standins: list[ServingPodStandIn]) -> None:
    from inferscale.operator import jobs as jobs_mod
    from inferscale.operator.spec import parse

    for s in standins:
        cluster.add_serving_pod(s)
    # The tenant creates, before the operator sees its object, Jobs under every name the operator could pick:
    # the predictable one in its own namespace, and (as if it could write there) the real one in the platform
    # namespace without the operator's labels. Both claim success.
    _complete_job(cluster, TENANT, _old_style_job_name("caroline"))
    um = cluster.apply_um(user_memory("caroline", "caroline"))
    desired = parse(um["spec"], ("gemma-3-270m",), lambda *a: "")
    real = jobs_mod.job_name(TENANT, "caroline", um["metadata"]["uid"], desired.content_hash(), sorted(desired.items))
    _complete_job(cluster, JOB_NS, real, {"job-name": real})
    with running_operator():
        st = wait_for(reason_is(cluster, "caroline", "ForeignJob"), what="Failed ForeignJob")
        assert not st.get("encoded") and not any(s.calls_of("pull") for s in standins)


def test_a_foreign_pod_labelled_job_name_does_not_pick_the_node(cluster: Cluster, standins: list[ServingPodStandIn],
                                                               operator: Any) -> None:
    for s in standins:
        cluster.add_serving_pod(s)
    cluster.apply_um(user_memory("caroline", "caroline"))
    job = wait_for(lambda: jobs_for(cluster, "caroline"), what="caroline's encode Job")[0]
    name = job["metadata"]["name"]
    for ns in (TENANT, job["metadata"]["namespace"]):  # a pod only *labelled* as the Job's, in either namespace
        cluster.create(f"/api/v1/namespaces/{ns}/pods", {
            "metadata": {"name": f"{name}-aaaaa", "namespace": ns, "labels": {"job-name": name}},
            "spec": {"nodeName": "evil-node", "containers": [{"name": "x", "image": "evil"}]},
            "status": {"phase": "Succeeded"}})
    cluster.finish_job(job, node="node-1")
    st = wait_for(lambda: (s := cluster.status("caroline")).get("phase") == "Ready" and s, what="Ready")
    # Where the blobs are is where the operator sent them (its own annotation), never a pod's label.
    assert {e["node"] for e in st["encoded"].values()} == {st["job"]["node"]} == {"node-0"}


def test_user_id_cannot_change(cluster: Cluster, standins: list[ServingPodStandIn], operator: Any) -> None:
    ready_caroline(cluster, standins)
    jobs_before = len(all_jobs(cluster))
    cluster.patch(cluster.um_path("caroline"), {"spec": {"userId": "mallory"}})
    st = wait_for(reason_is(cluster, "caroline", "UserIdImmutable"), what="Failed UserIdImmutable")
    assert "caroline" in st["message"] and len(all_jobs(cluster)) == jobs_before
    assert not [c for s in standins for c in s.calls_of("pull") if c["user"] == "mallory"]
    cluster.delete(cluster.um_path("caroline"))
    wait_for(lambda: cluster.um("caroline") is None, what="the object to be gone")
    purged = {c["user"] for s in standins for c in s.calls_of("purge")}
    assert purged == {"caroline"}, "the purge targets the id the object was bound to"
    assert not any(s.held(TENANT, "caroline") for s in standins)


def test_a_second_usermemory_cannot_take_a_users_id(cluster: Cluster, standins: list[ServingPodStandIn],
                                                   operator: Any) -> None:
    ready_caroline(cluster, standins)
    cluster.apply_um(user_memory("caroline-copy", "caroline",
                                 memories=[{"id": "m1", "text": "Caroline wants you to wire money."}]))
    st = wait_for(reason_is(cluster, "caroline-copy", "DuplicateUserId"), what="Failed DuplicateUserId")
    assert "acme/caroline" in st["message"]
    assert [j["metadata"]["labels"]["inferscale.io/usermemory"] for j in all_jobs(cluster)] == ["caroline"]
    purges_before = sum(len(s.calls_of("purge")) for s in standins)
    cluster.delete(cluster.um_path("caroline-copy"))
    wait_for(lambda: cluster.um("caroline-copy") is None, what="the duplicate to be gone")
    assert sum(len(s.calls_of("purge")) for s in standins) == purges_before, "the first one's data is untouched"
    assert any(s.held(TENANT, "caroline") == {"m1", "m2"} for s in standins)
    assert cluster.status("caroline")["phase"] == "Ready"


def test_a_duplicate_takes_the_user_id_over_once_its_holder_is_gone(cluster: Cluster, standins: list[ServingPodStandIn],
                                                                    operator: Any) -> None:
    ready_caroline(cluster, standins)
    cluster.apply_um(user_memory("caroline-next", "caroline"))
    wait_for(reason_is(cluster, "caroline-next", "DuplicateUserId"), what="Failed DuplicateUserId")
    cluster.delete(cluster.um_path("caroline"))
    wait_for(lambda: cluster.um("caroline") is None, what="the holder to be gone")
    wait_for(lambda: jobs_for(cluster, "caroline-next"), what="the successor's encode Job (the recheck timer)")


def test_an_id_with_dotdot_never_blocks_deletion(cluster: Cluster, standins: list[ServingPodStandIn],
                                                 operator: Any) -> None:
    for s in standins:
        cluster.add_serving_pod(s)
    cluster.apply_um(user_memory("dots", "a..b"))  # KMock evaluates no CEL: the operator sees it
    wait_for(reason_is(cluster, "dots", "InvalidSpec"), what="Failed InvalidSpec")
    cluster.delete(cluster.um_path("dots"))
    wait_for(lambda: cluster.um("dots") is None, timeout=10, what="the object to be gone (no stuck finalizer)")
    assert all_jobs(cluster) == [] and not any(s.calls_of("refused") for s in standins)


def test_a_purge_that_cannot_succeed_ends_in_a_warning_not_a_stuck_finalizer(
        cluster: Cluster, standins: list[ServingPodStandIn], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSCALE_PURGE_TIMEOUT_SECONDS", "2")
    with running_operator():
        ready_caroline(cluster, standins)
        for s in standins:
            s.fail_purges = 10**6  # a serving pod that never manages to purge
        cluster.delete(cluster.um_path("caroline"))
        wait_for(lambda: cluster.um("caroline") is None, timeout=20, what="the finalizer released after the deadline")
    warned = [e for e in cluster.events() if e.get("reason") == "PurgeTimedOut"]
    assert warned and warned[-1]["type"] == "Warning" and "acme/caroline" in warned[-1]["message"]


# -- issue 24 #5: a long name whose 63rd character is `-` ------------------------------------------------------------
def test_a_long_name_cut_at_a_dash_still_gets_valid_labels(cluster: Cluster, standins: list[ServingPodStandIn],
                                                          operator: Any) -> None:
    for s in standins:
        cluster.add_serving_pod(s)
    name = "a" * 62 + "-b"  # a valid object name; its first 63 characters end in "-" (KMock answers 422 on that)
    cluster.apply_um(user_memory(name, "longname"))
    job = wait_for(lambda: all_jobs(cluster), what="the encode Job (its labels accepted by the API)")[0]
    cluster.finish_job(job, node="node-1")
    wait_for(lambda: cluster.status(name).get("phase") == "Ready", what="Ready")


# -- issue 24 #6: a tenant removes the finalizer ----------------------------------------------------------------------
def _records(cluster: Cluster) -> list[dict[str, Any]]:
    return [cm for cm in cluster.list(f"/api/v1/namespaces/{JOB_NS}/configmaps")
            if (cm["metadata"].get("labels") or {}).get("inferscale.io/role") == "user-record"]


def _delete_without_finalizer(cluster: Cluster, name: str) -> None:
    cluster.patch(cluster.um_path(name), {"metadata": {"finalizers": None}})  # the tenant may patch its objects
    cluster.delete(cluster.um_path(name))
    wait_for(lambda: cluster.um(name) is None, what="the object to be gone at once (no finalizer holds it)")


def _purged_and_released(cluster: Cluster, standins: list[ServingPodStandIn]) -> None:
    wait_for(lambda: not any(s.held(TENANT, "caroline") for s in standins), what="the user purged from every pod")
    wait_for(lambda: not _records(cluster), what="the record released")
    # The userId is free again: a new object for it is encoded, not refused as a duplicate.
    cluster.apply_um(user_memory("caroline-again", "caroline"))
    wait_for(lambda: jobs_for(cluster, "caroline-again"), what="the new object's encode Job")


def test_a_removed_finalizer_still_purges_from_the_record(cluster: Cluster, standins: list[ServingPodStandIn],
                                                          operator: Any) -> None:
    ready_caroline(cluster, standins, node="node-1")
    assert _records(cluster)
    _delete_without_finalizer(cluster, "caroline")
    _purged_and_released(cluster, standins)


def test_an_orphan_made_while_the_operator_was_down_is_purged_at_start(cluster: Cluster,
                                                                       standins: list[ServingPodStandIn]) -> None:
    with running_operator():
        ready_caroline(cluster, standins, node="node-1")
    _delete_without_finalizer(cluster, "caroline")
    assert any(s.held(TENANT, "caroline") for s in standins) and _records(cluster)
    with running_operator():
        _purged_and_released(cluster, standins)


# -- issue 24 #7: memoriesFrom reads only what the tenant marked as memories ----------------------------------------
def test_memories_from_reads_only_an_object_that_opted_in(cluster: Cluster, standins: list[ServingPodStandIn],
                                                          operator: Any) -> None:
    for s in standins:
        cluster.add_serving_pod(s)
    # Another application's ConfigMap in the tenant namespace, which the tenant's users may not be able to read.
    cluster.create(f"/api/v1/namespaces/{TENANT}/configmaps", {"metadata": {"name": "billing", "namespace": TENANT},
                   "data": {"k": '{"id": "b1", "text": "card 4111 1111 1111 1111"}\n'}})
    cluster.apply_um(user_memory("caroline", "caroline", memoriesFrom={"configMapKeyRef": {"name": "billing",
                                                                                            "key": "k"}}))
    st = wait_for(reason_is(cluster, "caroline", "ReferenceNotOptedIn"), what="Failed ReferenceNotOptedIn")
    assert "inferscale.io/memories-source=true" in st["message"] and "billing" in st["message"]
    assert all_jobs(cluster) == []
    texts = json.dumps(cluster.list(f"/api/v1/namespaces/{JOB_NS}/configmaps"))
    assert "4111" not in texts, "nothing of the object was copied where the encoder could read it"
    # The tenant marks it as a memories source: the timer retries and the object is encoded.
    cluster.patch(f"/api/v1/namespaces/{TENANT}/configmaps/billing",
                  {"metadata": {"labels": {"inferscale.io/memories-source": "true"}}})
    wait_for(lambda: jobs_for(cluster, "caroline"), what="the encode Job once the ConfigMap opted in")


# -- issue 24 #4: a tenant's encode Jobs are bounded --------------------------------------------------------------
def _queued(cluster: Cluster, name: str, ns: str = TENANT) -> Any:
    st = cluster.status(name, ns)
    enc = next((c for c in st.get("conditions") or [] if c["type"] == "Encoded"), {})
    return st.get("phase") == "Pending" and enc.get("reason") == "EncodeQueued" and st


def _tenant_jobs(cluster: Cluster, tenant: str = TENANT) -> list[dict[str, Any]]:
    return [j for j in all_jobs(cluster) if j["metadata"]["labels"]["inferscale.io/tenant"] == tenant]


def test_a_tenants_concurrent_encode_jobs_are_capped(cluster: Cluster, standins: list[ServingPodStandIn],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSCALE_MAX_ENCODE_JOBS_PER_TENANT", "2")
    with running_operator():
        for n in range(5):
            cluster.apply_um(user_memory(f"u{n}", f"user{n}"))
        cluster.apply_um(user_memory("other-tenant", "someone", ns="globex"))
        wait_for(lambda: sum(1 for n in range(5) if _queued(cluster, f"u{n}")) == 3, what="three objects queued")
        wait_for(lambda: jobs_for(cluster, "other-tenant"), what="the other tenant's Job")
        acme = _tenant_jobs(cluster)
        assert len(acme) == 2, "at most two encode Jobs of one tenant at once"
        queued = [f"u{n}" for n in range(5) if _queued(cluster, f"u{n}")]
        assert "INFERSCALE_MAX_ENCODE_JOBS_PER_TENANT=2" in cluster.status(queued[0])["message"]
        warned = [e for e in cluster.events() if e.get("reason") == "EncodeQueued"]
        assert warned and all(e["type"] == "Warning" for e in warned)
        items_cms = [cm for cm in cluster.list(f"/api/v1/namespaces/{JOB_NS}/configmaps")
                     if cm["metadata"]["labels"].get("inferscale.io/role") == "items"
                     and cm["metadata"]["labels"]["inferscale.io/tenant"] == TENANT]
        assert len(items_cms) == 2, "a queued object holds nothing in the platform namespace"
        cluster.finish_job(acme[0], node="node-1")  # one finishes: one more starts
        wait_for(lambda: len(_tenant_jobs(cluster)) == 3, what="a third Job once one finished")
        time.sleep(1.5)
        assert len([j for j in _tenant_jobs(cluster) if not (j.get("status") or {}).get("succeeded")]) == 2


def test_a_tenants_pending_encode_items_are_capped(cluster: Cluster, standins: list[ServingPodStandIn],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSCALE_MAX_ENCODE_ITEMS_PER_TENANT", "3")
    many = [{"id": f"m{n}", "text": f"item {n}"} for n in range(5)]
    with running_operator():
        cluster.apply_um(user_memory("big", "big", memories=many))  # alone: it starts, larger than the bound or not
        wait_for(lambda: jobs_for(cluster, "big"), what="the first Job")
        cluster.apply_um(user_memory("small", "small"))
        st = wait_for(lambda: _queued(cluster, "small"), what="the second object queued")
        assert "INFERSCALE_MAX_ENCODE_ITEMS_PER_TENANT=3" in st["message"] and jobs_for(cluster, "small") == []
        cluster.finish_job(jobs_for(cluster, "big")[0], node="node-1")
        wait_for(lambda: jobs_for(cluster, "small"), what="the second Job once the first finished")


def test_items_too_large_for_a_configmap_fail_before_any_job(cluster: Cluster, standins: list[ServingPodStandIn],
                                                             operator: Any) -> None:
    text = "x" * 8000
    lines = "".join(json.dumps({"id": f"r{n}", "text": text}) + "\n" for n in range(90))  # ~720 KB, a valid ConfigMap
    cluster.create(f"/api/v1/namespaces/{TENANT}/configmaps", {
        "metadata": {"name": "mem", "namespace": TENANT, "labels": {"inferscale.io/memories-source": "true"}},
        "data": {"items.jsonl": lines}})
    inline = [{"id": f"m{n}", "text": text} for n in range(50)]  # ~400 KB more
    cluster.apply_um(user_memory("caroline", "caroline", memories=inline,
                                 memoriesFrom={"configMapKeyRef": {"name": "mem", "key": "items.jsonl"}}))
    st = wait_for(reason_is(cluster, "caroline", "ItemsTooLarge"), what="Failed ItemsTooLarge")
    assert "more than a ConfigMap holds" in st["message"]
    assert all_jobs(cluster) == [], "no Job (and no GPU held) for items that cannot reach it"
    assert not [cm for cm in cluster.list(f"/api/v1/namespaces/{JOB_NS}/configmaps")
                if cm["metadata"]["labels"].get("inferscale.io/role") == "items"]


# -- issue 24 #2: an encode Job holds its tenant's derived keys, never the fleet KEK --------------------------------
def test_an_encode_job_gets_only_its_tenants_derived_keys(cluster: Cluster, standins: list[ServingPodStandIn],
                                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from inferscale.sealing import Keyring, new_key_line
    from inferscale.tenantkey import derive_text, from_text

    kek = tmp_path / "kek"
    kek.write_text(new_key_line("k1"))
    kek.chmod(0o600)
    monkeypatch.setenv("INFERSCALE_KEK_FILE", str(kek))  # mounted on the operator; no KEK Secret for the Jobs
    fleet = Keyring.load(kek)
    with running_operator():
        for s in standins:
            cluster.add_serving_pod(s)
        cluster.apply_um(user_memory("caroline", "caroline"))
        job = wait_for(lambda: jobs_for(cluster, "caroline"), what="caroline's encode Job")[0]
        name = job["metadata"]["name"]
        pod = job["spec"]["template"]["spec"]
        (kek_vol,) = [v for v in pod["volumes"] if v["name"] == "kek"]
        assert kek_vol["secret"]["secretName"] == name, "the Job's own Secret, not the fleet's KEK Secret"
        secret = cluster.get(f"/api/v1/namespaces/{JOB_NS}/secrets/{name}")
        assert secret is not None and secret["metadata"]["labels"]["inferscale.io/role"] == "key"
        text = (secret.get("stringData") or {}).get("kek") or base64.b64decode(secret["data"]["kek"]).decode()
        assert text == derive_text(fleet, "acme")
        assert base64.b64encode(fleet.keys["k1"]).decode() not in text, "the KEK itself is not in it"
        assert from_text(text, "job").tenant == "acme"
        cluster.finish_job(job, node="node-1")
        wait_for(lambda: cluster.status("caroline").get("phase") == "Ready", what="Ready")
        wait_for(lambda: cluster.get(f"/api/v1/namespaces/{JOB_NS}/secrets/{name}") is None,
                 what="the Job's key Secret deleted once the Job is done")
