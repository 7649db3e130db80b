"""The operator's side of the fleet path (operator/fleet.py), with the real operator against KMock and stand-in
serving pods: peers published from pod IPs (never from anything a tenant or a pod annotation names), stale
copies dropped after an edit, items ConfigMaps cleaned."""

from __future__ import annotations

from typing import Any

from conftest import JOB_NS, TENANT, Cluster, wait_for
from operator_fakes import serving_pods
from test_operator_lifecycle import MEMORIES, caroline, only_ids, phase_is

from inferscale.operator.servers import ServingPod


def test_peer_address_is_pod_ip_and_nixl_port_never_an_annotation() -> None:
    raw = {"metadata": {"name": "p", "namespace": "ns", "annotations": {"inferscale.io/nixl-peer": "6.6.6.6:1"}},
           "spec": {"nodeName": "n"},
           "status": {"phase": "Running", "podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}]}}
    pod = ServingPod.from_pod(raw, 8001, nixl_port=5555)
    assert pod is not None and pod.peer == "10.1.2.3:5555"
    raw["status"]["podIP"] = "fd00::7"
    assert ServingPod.from_pod(raw, 8001, nixl_port=5555).peer == "[fd00::7]:5555"


def test_peers_published_and_a_tenant_cannot_redirect_them(cluster: Cluster, operator: Any) -> None:
    with serving_pods(3) as pods:
        for n, s in enumerate(pods):  # one forged annotation: it must change nothing
            cluster.add_serving_pod(s, pod_ip=f"10.0.0.{n + 1}",
                                    annotations={"inferscale.io/nixl-peer": "6.6.6.6:5555"} if n == 0 else None)
        cluster.apply_um(caroline(replicas=1))
        job = wait_for(cluster.jobs, what="an encode Job")[0]
        cluster.finish_job(job, node="node-0")
        wait_for(phase_is(cluster, "Ready"), what="phase Ready")
        want = {f"10.0.0.{n + 1}:5555" for n in range(3)}
        for n, s in enumerate(pods):
            assert set(wait_for(lambda s=s: s.peers, what="published peers")) == want - {f"10.0.0.{n + 1}:5555"}
        # The tenant writes its own status: a forged placement naming an attacker's peer and pod.
        forged = [{"node": "node-9", "pod": "evil", "namespace": JOB_NS, "peer": "6.6.6.6:5555", "tier": "dram"}]
        cluster.patch(cluster.um_path("caroline") + "/status", {"status": {"placements": forged}})
        cluster.patch(cluster.um_path("caroline"), {"spec": {"memories": MEMORIES[:2]}})
        wait_for(lambda: cluster.status("caroline").get("observedGeneration") == 2, what="generation 2")
        for s in pods:
            for body in s.calls_of("peers"):
                assert "6.6.6.6:5555" not in body["peers"]
            for pull in s.calls_of("pull"):
                assert pull["source"]["peer"] in (None, *want)


def test_edit_drops_stale_copies_and_configmaps(cluster: Cluster, operator: Any) -> None:
    with serving_pods(3) as pods:
        for s in pods:
            cluster.add_serving_pod(s)
        cluster.apply_um(caroline(replicas=1))
        first = wait_for(cluster.jobs, what="an encode Job")[0]
        cluster.finish_job(first, node="node-0")
        before = wait_for(phase_is(cluster, "Ready"), what="phase Ready")
        placed = before["placements"][0]["pod"]
        # The items ConfigMap (every memory text) is gone once its Job is done.
        wait_for(lambda: cluster.get(f"/api/v1/namespaces/{JOB_NS}/configmaps/{first['metadata']['name']}") is None,
                 what="the first items ConfigMap deleted")
        edited = [dict(MEMORIES[0]), {**MEMORIES[1], "text": "Caroline adopted a dog."}]  # m2 edited, m3 removed
        cluster.patch(cluster.um_path("caroline"), {"spec": {"memories": edited}})
        second = wait_for(lambda: [j for j in cluster.jobs() if only_ids(j) == ["m2"]], what="a second Job")[0]
        cluster.finish_job(second, node="node-1")
        wait_for(lambda: (st := cluster.status("caroline")).get("observedGeneration") == 2
                 and st.get("phase") == "Ready" and st, what="Ready at generation 2")
        for s in pods:
            if s.pod != placed:  # any on-demand copy of the old version is dropped: the pod refetches
                assert {"tenant": TENANT, "user": "caroline", "items": None} in s.calls_of("purge"), s.pod
        for s in pods:  # no Job dir anywhere: no purge names one
            assert not [p for p in s.calls_of("purge") if p.get("source_dir")], s.pod
        wait_for(lambda: not cluster.list(f"/api/v1/namespaces/{JOB_NS}/configmaps?labelSelector="
                                          "inferscale.io/role%3Ditems"), what="no items ConfigMap left")


