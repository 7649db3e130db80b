"""The real operator (KopfRunner, --standalone -A) against the KMock emulator and stand-in serving pods."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from conftest import JOB_NS, SERVER_NS, TENANT, TOKEN, Cluster, running_operator, wait_for
from operator_fakes import ServingPodStandIn

MEMORIES = [
    {"id": "m1", "text": "Caroline went to a support group.", "timestamp": "2023-05-08"},
    {"id": "m2", "text": "Caroline is researching adoption agencies.", "timestamp": "2023-05-25"},
    {"id": "m3", "text": "Caroline likes painting."},
]


def caroline(replicas: int = 2, memories: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "inferscale.io/v1alpha1", "kind": "UserMemory",
        "metadata": {"name": "caroline", "namespace": TENANT},
        "spec": {"userId": "caroline", "model": "gemma-3-270m", "memories": memories or MEMORIES,
                 "placement": {"replicas": replicas}},
    }


def only_ids(job: dict[str, Any]) -> list[str]:
    cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    return cmd[cmd.index("--only") + 1].split(",")


def phase_is(cluster: Cluster, phase: str, name: str = "caroline") -> Any:
    return lambda: (st := cluster.status(name)).get("phase") == phase and st


def ready(cluster: Cluster, standins: list[ServingPodStandIn], replicas: int = 2) -> dict[str, Any]:
    """Apply caroline, finish her Job, wait for Ready: the common start of several scenarios."""
    for s in standins:
        cluster.add_serving_pod(s)
    cluster.apply_um(caroline(replicas))
    job = wait_for(cluster.jobs, what="an encode Job")[0]
    cluster.finish_job(job)
    return wait_for(phase_is(cluster, "Ready"), what="phase Ready")


def test_apply_encodes_then_places(cluster: Cluster, standins: list[ServingPodStandIn], operator: Any) -> None:
    for s in standins:
        cluster.add_serving_pod(s)
    um = cluster.apply_um(caroline(replicas=2))

    jobs = wait_for(cluster.jobs, what="an encode Job")
    assert len(jobs) == 1
    job = jobs[0]
    pod_spec = job["spec"]["template"]["spec"]
    container = pod_spec["containers"][0]
    assert container["command"][:3] == ["inferscale", "encode", "/memories/items.jsonl"]
    assert container["command"][container["command"].index("--out") + 1] == "/var/run/inferscale/out"
    assert "--embed" in container["command"] and only_ids(job) == ["m1", "m2", "m3"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod_spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert not [v for v in volumes.values() if "hostPath" in v], "no node directory: Pod Security restricted"
    assert volumes["out"]["emptyDir"] and "--deliver" in container["command"]
    assert volumes["memories"]["configMap"]["name"] == job["metadata"]["name"]
    assert job["metadata"]["namespace"] == JOB_NS
    assert job["metadata"]["labels"]["inferscale.io/owner-uid"] == um["metadata"]["uid"]
    # Made before the Job (an oversized one fails before a GPU is held), then owned by it: collected with its Job.
    cm = wait_for(lambda: (c := cluster.get(f"/api/v1/namespaces/{JOB_NS}/configmaps/{job['metadata']['name']}"))
                  and c["metadata"].get("ownerReferences") and c, what="the items ConfigMap, owned by the Job")
    assert cm["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert [json.loads(line)["id"] for line in cm["data"]["items.jsonl"].splitlines()] == ["m1", "m2", "m3"]
    wait_for(phase_is(cluster, "Encoding"), what="phase Encoding")
    assert not any(s.calls_of("pull") for s in standins), "nothing is pulled before the Job succeeded"

    cluster.finish_job(job, node="gpu-node-0")
    status = wait_for(phase_is(cluster, "Ready"), what="phase Ready")

    assert sorted((p["node"], p["pod"]) for p in status["placements"]) == [
        ("node-0", "inferscale-server-0"), ("node-1", "inferscale-server-1")]
    assert status["counts"] == {"items": 3, "tokens": 30, "bytes": 3000}
    assert status["nodes"] == "node-0,node-1"
    # The Job delivered to the first serving pod (the placement's choice), which then holds the blobs.
    assert status["observedGeneration"] == 1 and status["job"]["node"] == "node-0"
    assert status["job"]["pod"] == f"{SERVER_NS}/inferscale-server-0"
    assert standins[0].calls_of("ingest") == [{"tenant": TENANT, "user": "caroline", "items": ["m1", "m2", "m3"]}]
    assert standins[1].calls_of("ingest") == []
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Valid": "True", "Encoded": "True", "Placed": "True", "Ready": "True"}
    for s in standins:  # the holder answers from its store; the other pod fetches from it (its peer address)
        (pull,) = s.calls_of("pull")
        assert pull["source"] == {"node": "node-0", "peer": None if s is standins[0] else "127.0.0.1:5555"}
        assert pull["items"] == ["m1", "m2", "m3"] and (pull["tenant"], pull["user"]) == (TENANT, "caroline")
        assert s.held(TENANT, "caroline") == {"m1", "m2", "m3"}
        assert {a for a in s.auth if not a.startswith("Bearer isu1.")} == {f"Bearer {TOKEN}"}
    wanted = {"EncodeStarted", "Encoded", "Placed"}
    wait_for(lambda: wanted <= {e.get("reason") for e in cluster.events()}, what=f"events {wanted}")


def test_jobs_in_the_platform_namespace_touch_no_secret(cluster: Cluster, standins: list[ServingPodStandIn],
                                                        operator: Any) -> None:
    """No INFERSCALE_KEK_FILE: the Jobs share the platform namespace and mount the KEK Secret; the operator makes no
    key Secret there and, the chart granting it no right on that namespace's Secrets, lists none either (a real API
    server answers 403 and the object never got past its finished Job)."""
    ready(cluster, standins)
    assert cluster.requests_for("secrets") == []


def test_edit_one_memory_encodes_only_that_item(cluster: Cluster, standins: list[ServingPodStandIn],
                                                operator: Any) -> None:
    before = ready(cluster, standins)
    edited = [dict(MEMORIES[0]), {**MEMORIES[1], "text": "Caroline adopted a dog."}]  # m2 edited, m3 removed
    cluster.patch(cluster.um_path("caroline"), {"spec": {"memories": edited}})

    jobs = wait_for(lambda: len(j := cluster.jobs()) == 2 and j, what="a second Job")
    new_job = next(j for j in jobs if only_ids(j) != ["m1", "m2", "m3"])
    assert only_ids(new_job) == ["m2"]  # m1 (before it) is unchanged; m3, which sat behind it, is gone
    cm = wait_for(lambda: cluster.get(f"/api/v1/namespaces/{JOB_NS}/configmaps/{new_job['metadata']['name']}"),
                  what="the items ConfigMap")
    # every item, in spec order: m2 is encoded behind m1
    assert cm is not None and [json.loads(line) for line in cm["data"]["items.jsonl"].splitlines()] == edited
    cluster.finish_job(new_job, node="gpu-node-1")
    after = wait_for(lambda: (st := cluster.status("caroline")).get("observedGeneration") == 2
                     and st.get("phase") == "Ready" and st, what="Ready at generation 2")

    assert after["contentHash"] != before["contentHash"]
    assert sorted(after["encoded"]) == ["m1", "m2"]
    # The new Job delivered where the user already was (the placement's first pod), not where it ran.
    assert after["encoded"]["m2"]["node"] == "node-0" and after["encoded"]["m1"]["node"] == "node-0"
    assert standins[0].calls_of("ingest")[-1]["items"] == ["m2"]
    assert [p["pod"] for p in after["placements"]] == [p["pod"] for p in before["placements"]], "placement stable"
    for s in standins:
        pulls = s.calls_of("pull")
        assert len(pulls) == 2 and pulls[1]["items"] == ["m2"]
        assert pulls[1]["source"]["node"] == "node-0"
        assert {"tenant": TENANT, "user": "caroline", "items": ["m3"]} in s.calls_of("purge")
        assert s.held(TENANT, "caroline") == {"m1", "m2"}


def test_delete_waits_for_purge(cluster: Cluster, standins: list[ServingPodStandIn], operator: Any) -> None:
    ready(cluster, standins)
    standins[0].fail_purges = 2  # the first two purges on pod 0 answer 500
    cluster.delete(cluster.um_path("caroline"))

    wait_for(lambda: len(standins[0].calls_of("purge")) >= 2, what="two failed purges")
    held = cluster.um("caroline")
    assert held is not None and held["metadata"].get("deletionTimestamp"), "the finalizer holds the object"
    assert held["metadata"]["finalizers"] == ["inferscale.io/purge"]
    wait_for(lambda: cluster.um("caroline") is None, what="the object to be gone")
    for s in standins:
        assert s.held(TENANT, "caroline") == set()
        assert s.calls_of("purge")[-1] == {"tenant": TENANT, "user": "caroline", "items": None}
    assert len(standins[0].calls_of("purge")) == 3
    # The Job ran on gpu-node-0, which is no Node (any more): its output went with it, no cleanup Job.
    assert len(cluster.jobs()) == 1


def test_delete_purges_every_serving_pod_and_runs_no_node_job(
        cluster: Cluster, standins: list[ServingPodStandIn], operator: Any) -> None:
    """Jobs keep nothing on a node (they deliver): a deletion purges the serving pods' stores, names no node
    directory and starts no Job."""
    ready(cluster, standins)
    cluster.delete(cluster.um_path("caroline"))
    wait_for(lambda: cluster.um("caroline") is None, what="the object to be gone")
    for s in standins:
        assert s.calls_of("purge")[-1] == {"tenant": TENANT, "user": "caroline", "items": None}
        assert s.held(TENANT, "caroline") == set()
    assert len(cluster.jobs()) == 1, "only the encode Job: no cleanup Job"
    purged = [e for e in cluster.events() if e.get("reason") == "Purged"]
    assert purged and "from 2 serving pod(s)" in purged[-1]["message"]


def test_restart_mid_encode_makes_no_duplicate_job(cluster: Cluster, standins: list[ServingPodStandIn]) -> None:
    for s in standins:
        cluster.add_serving_pod(s)
    with running_operator():
        cluster.apply_um(caroline())
        job = wait_for(cluster.jobs, what="an encode Job")[0]
        wait_for(phase_is(cluster, "Encoding"), what="phase Encoding")

    reads = cluster.job_requests("GET")
    with running_operator():
        # The restarted operator re-derives the same Job name from the content hash and finds the Job.
        wait_for(lambda: cluster.job_requests("GET") > reads + 1, what="the new operator to look at the Job")
        assert cluster.job_requests("POST") == 1, "no second create, not even one answered 409"
        cluster.finish_job(job)
        status = wait_for(phase_is(cluster, "Ready"), what="phase Ready after restart")
        assert [j["metadata"]["name"] for j in cluster.jobs()] == [job["metadata"]["name"]]
    assert status["counts"] == {"items": 3, "tokens": 30, "bytes": 3000}
    assert sorted(p["pod"] for p in status["placements"]) == ["inferscale-server-0", "inferscale-server-1"]
    assert sorted(status["encoded"]) == ["m1", "m2", "m3"]
    for s in standins:
        assert s.held(TENANT, "caroline") == {"m1", "m2", "m3"}


def test_invalid_spec_fails_and_keeps_the_placement(cluster: Cluster, standins: list[ServingPodStandIn],
                                                   operator: Any) -> None:
    good = ready(cluster, standins)
    cases = [
        ({"model": "no-such-model"}, "UnknownModel", "no-such-model"),
        ({"model": "gemma-3-270m", "memoriesFrom": {"configMapKeyRef": {"name": "missing", "key": "m.jsonl"}}},
         "ReferenceNotFound", "ConfigMap acme/missing not found"),
    ]
    cluster.create(f"/api/v1/namespaces/{TENANT}/configmaps", {
        "metadata": {"name": "bad-lines", "namespace": TENANT, "labels": {"inferscale.io/memories-source": "true"}},
        "data": {"m.jsonl": '{"id": "x1", "text": "fine"}\n{"id": "x2", "text": \n'}})
    cases.append(({"memoriesFrom": {"configMapKeyRef": {"name": "bad-lines", "key": "m.jsonl"}}},
                  "InvalidMemory", "line 2: malformed JSON"))
    cases.append(({"memoriesFrom": {"configMapKeyRef": {"name": "bad-lines", "key": "other"}}},
                  "ReferenceNotFound", "has no key 'other'"))
    for gen, (spec, reason, text) in enumerate(cases, start=2):
        cluster.patch(cluster.um_path("caroline"), {"spec": spec})
        st = wait_for(lambda: (s := cluster.status("caroline")).get("observedGeneration") == gen and s,
                      what=f"generation {gen} handled")
        assert st["phase"] == "Failed"
        valid = next(c for c in st["conditions"] if c["type"] == "Valid")
        assert (valid["status"], valid["reason"]) == ("False", reason) and text in valid["message"]
        # Ready speaks for this generation: not True from the last good one (whose blocks keep serving).
        ready_cond = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert (ready_cond["status"], ready_cond["reason"], ready_cond["observedGeneration"]) == ("False", reason, gen)
        assert st["placements"] == good["placements"] and st["encoded"] == good["encoded"]
    assert len(cluster.jobs()) == 1, "a bad spec starts no Job"
    for s in standins:
        assert s.calls_of("purge") == [] and s.held(TENANT, "caroline") == {"m1", "m2", "m3"}

    # Fixed: Ready again, without re-encoding anything.
    cluster.patch(cluster.um_path("caroline"), {"spec": {"memoriesFrom": None}})
    wait_for(lambda: (s := cluster.status("caroline")).get("observedGeneration") == 6 and s["phase"] == "Ready",
             what="Ready after the fix")
    assert len(cluster.jobs()) == 1


def test_missing_reference_is_retried_until_it_appears(cluster: Cluster, standins: list[ServingPodStandIn],
                                                      operator: Any) -> None:
    for s in standins:
        cluster.add_serving_pod(s)
    um = caroline(replicas=1)
    um["spec"]["memoriesFrom"] = {"configMapKeyRef": {"name": "later", "key": "items.jsonl"}}
    cluster.apply_um(um)
    st = wait_for(phase_is(cluster, "Failed"), what="phase Failed")
    valid = next(c for c in st["conditions"] if c["type"] == "Valid")
    assert valid["reason"] == "ReferenceNotFound" and "ConfigMap acme/later not found" in valid["message"]

    def warnings(text: str) -> list[dict[str, Any]]:
        return [e for e in cluster.events() if e.get("reason") == "ReferenceNotFound" and text in e.get("message", "")]

    # Retried every recheck interval (1 s here), quietly: one Event per distinct problem, not one per try.
    gets = cluster.emu.call(lambda: sum(1 for r in cluster.emu.emulator if r.method == "GET"
                                        and r.resource is not None and r.resource.plural == "configmaps"))
    wait_for(lambda: cluster.emu.call(lambda: sum(1 for r in cluster.emu.emulator if r.method == "GET"
                                                  and r.resource is not None and r.resource.plural == "configmaps"))
             >= gets + 2, what="two more looks at the ConfigMap")
    assert len(warnings("not found")) == 1 and cluster.jobs() == []

    # The ConfigMap appears without the key: still Failed, now saying so.
    cluster.create(f"/api/v1/namespaces/{TENANT}/configmaps", {
        "metadata": {"name": "later", "namespace": TENANT, "labels": {"inferscale.io/memories-source": "true"}},
        "data": {"other": ""}})
    wait_for(lambda: warnings("has no key 'items.jsonl'"), what="the missing key reported")
    assert cluster.status("caroline")["phase"] == "Failed"
    # The key appears: encoded, placed, Ready, with no spec change.
    cluster.patch(f"/api/v1/namespaces/{TENANT}/configmaps/later",
                  {"data": {"items.jsonl": '{"id": "r1", "text": "from the late ConfigMap"}\n'}})
    job = wait_for(cluster.jobs, what="an encode Job")[0]
    assert only_ids(job) == ["m1", "m2", "m3", "r1"]
    wait_for(phase_is(cluster, "Encoding"), what="phase Encoding")
    cluster.finish_job(job)
    st = wait_for(phase_is(cluster, "Ready"), what="phase Ready")
    assert st["observedGeneration"] == 1 and sorted(st["encoded"]) == ["m1", "m2", "m3", "r1"]
    assert {c["type"]: c["status"] for c in st["conditions"]}["Valid"] == "True"
    assert len(cluster.jobs()) == 1
    (placed,) = st["placements"]
    held = next(s for s in standins if s.pod == placed["pod"])
    assert held.held(TENANT, "caroline") == {"m1", "m2", "m3", "r1"}


def test_failed_job_fails_and_keeps_the_placement(cluster: Cluster, standins: list[ServingPodStandIn],
                                                  operator: Any) -> None:
    good = ready(cluster, standins)
    cluster.patch(cluster.um_path("caroline"), {"spec": {"memories": [*MEMORIES, {"id": "m9", "text": "x"}]}})
    job = wait_for(lambda: [j for j in cluster.jobs() if only_ids(j) == ["m9"]], what="a Job for m9")[0]
    cluster.finish_job(job, ok=False)
    st = wait_for(phase_is(cluster, "Failed"), what="phase Failed")
    encoded = next(c for c in st["conditions"] if c["type"] == "Encoded")
    assert encoded["reason"] == "EncodeJobFailed" and "bad item m9" in encoded["message"]
    ready_cond = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (ready_cond["status"], ready_cond["reason"]) == ("False", "EncodeJobFailed")
    assert ready_cond["observedGeneration"] == st["observedGeneration"]
    assert st["placements"] == good["placements"] and "m9" not in st["encoded"]


def test_lost_serving_pod_is_replaced(cluster: Cluster, operator: Any) -> None:
    from operator_fakes import serving_pods

    with serving_pods(3) as standins:
        standins[2].used = 10**9 - 1  # nearly full: chosen last
        first = ready(cluster, standins, replicas=2)
        assert sorted(p["pod"] for p in first["placements"]) == ["inferscale-server-0", "inferscale-server-1"]
        cluster.delete("/api/v1/namespaces/inferscale-system/pods/inferscale-server-0")

        st = wait_for(lambda: (s := cluster.status("caroline")).get("phase") == "Ready"
                      and "inferscale-server-2" in [p["pod"] for p in s["placements"]] and s, what="re-placed")
        assert sorted(p["pod"] for p in st["placements"]) == ["inferscale-server-1", "inferscale-server-2"]
        phases = [(v.get("status") or {}).get("phase") for v in cluster.um_history("caroline")]
        assert "Degraded" in phases[phases.index("Ready"):], "Degraded between the loss and the re-placement"
        (pull,) = standins[2].calls_of("pull")
        assert pull["items"] == ["m1", "m2", "m3"]
        assert len(standins[1].calls_of("pull")) == 1, "the surviving replica is not pulled again"


def test_secret_reference_and_inline_items_merge(cluster: Cluster, standins: list[ServingPodStandIn],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSCALE_READ_TENANT_SECRETS", "true")  # the platform team opted in
    with running_operator():
        _secret_reference_and_inline_items_merge(cluster, standins)


def _secret_reference_and_inline_items_merge(cluster: Cluster, standins: list[ServingPodStandIn]) -> None:
    for s in standins:
        cluster.add_serving_pod(s)
    jsonl = '{"id": "s1", "text": "from the secret"}\n{"id": "m1", "text": "overridden inline"}\n'
    cluster.create(f"/api/v1/namespaces/{TENANT}/secrets", {
        "metadata": {"name": "mem", "namespace": TENANT, "labels": {"inferscale.io/memories-source": "true"}},
        "data": {"items.jsonl": base64.b64encode(jsonl.encode()).decode()}})
    um = caroline(replicas=1)
    um["spec"]["memoriesFrom"] = {"secretKeyRef": {"name": "mem", "key": "items.jsonl"}}
    cluster.apply_um(um)
    job = wait_for(cluster.jobs, what="an encode Job")[0]
    assert only_ids(job) == ["m1", "m2", "m3", "s1"]
    cm = wait_for(lambda: cluster.get(f"/api/v1/namespaces/{JOB_NS}/configmaps/{job['metadata']['name']}"),
                  what="the items ConfigMap")
    texts = {json.loads(line)["id"]: json.loads(line)["text"] for line in cm["data"]["items.jsonl"].splitlines()}
    assert texts["m1"] == MEMORIES[0]["text"] and texts["s1"] == "from the secret"


@pytest.mark.parametrize("replicas", [3])
def test_too_few_pods_is_degraded(cluster: Cluster, standins: list[ServingPodStandIn], operator: Any,
                                  replicas: int) -> None:
    for s in standins:
        cluster.add_serving_pod(s)
    cluster.apply_um(caroline(replicas=replicas))
    cluster.finish_job(wait_for(cluster.jobs, what="an encode Job")[0])
    st = wait_for(phase_is(cluster, "Degraded"), what="phase Degraded")
    assert len(st["placements"]) == 2
    ready_cond = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready_cond["reason"] == "InsufficientReplicas" and "2/3" in ready_cond["message"]
