"""Fixtures: an emulated cluster (KMock), stand-in serving pods, and the real operator (KopfRunner)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import kopf
import pytest
from kopf.testing import KopfRunner

from operator_fakes import TOKEN, EmulatorThread, ServingPodStandIn, deliver, serving_pods

T = TypeVar("T")
TENANT = "acme"
SERVER_NS = "inferscale-system"
JOB_NS = SERVER_NS  # the platform namespace: Jobs, their items ConfigMaps and the per-user records
UM = "apis/inferscale.io/v1alpha1"


def wait_for(fn: Callable[[], T], timeout: float = 15.0, what: str = "condition") -> T:
    """Poll `fn` until it returns something truthy; fail with the last value after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


class Cluster:
    """The emulated API, used over HTTP like kubectl would (so watch events fire)."""

    def __init__(self, emu: EmulatorThread) -> None:
        self.emu = emu
        self.http = httpx.Client(base_url=emu.url, timeout=5)

    def _ok(self, resp: httpx.Response) -> dict[str, Any]:
        assert resp.status_code < 300, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
        return resp.json()

    def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        return self._ok(self.http.post(path, json=obj))

    def get(self, path: str) -> dict[str, Any] | None:
        resp = self.http.get(path)
        return None if resp.status_code == 404 else self._ok(resp)

    def list(self, path: str) -> list[dict[str, Any]]:
        return list(self._ok(self.http.get(path))["items"])

    def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._ok(self.http.patch(path, json=body, headers={"Content-Type": "application/merge-patch+json"}))

    def delete(self, path: str) -> None:
        self._ok(self.http.delete(path))

    # --- UserMemory helpers -------------------------------------------------------------------------
    def um_path(self, name: str, ns: str = TENANT) -> str:
        return f"/{UM}/namespaces/{ns}/usermemories/{name}"

    def apply_um(self, obj: dict[str, Any]) -> dict[str, Any]:
        ns = obj["metadata"].get("namespace", TENANT)
        return self.create(f"/{UM}/namespaces/{ns}/usermemories", obj)

    def um(self, name: str, ns: str = TENANT) -> dict[str, Any] | None:
        return self.get(self.um_path(name, ns))

    def status(self, name: str, ns: str = TENANT) -> dict[str, Any]:
        return (self.um(name, ns) or {}).get("status") or {}

    def um_history(self, name: str, ns: str = TENANT) -> list[dict[str, Any]]:
        key = ("inferscale.io/v1alpha1/usermemories", ns, name)
        return self.emu.call(lambda: [dict(v.raw) for v in self.emu.emulator.objects[key].history if v is not None])

    def jobs(self, ns: str = JOB_NS) -> list[dict[str, Any]]:
        return self.list(f"/apis/batch/v1/namespaces/{ns}/jobs")

    def requests_for(self, plural: str) -> list[str]:
        """The methods of every request for `plural` (say "jobs") that reached the API, answered 409 included."""
        return self.emu.call(lambda: [r.method.value for r in self.emu.emulator
                                      if r.resource is not None and r.resource.plural == plural])

    def job_requests(self, method: str) -> int:
        """How many requests of `method` for Jobs reached the API (POSTs answered 409 included)."""
        return self.requests_for("jobs").count(method)

    def finish_job(self, job: dict[str, Any], node: str = "gpu-node-0", ok: bool = True) -> None:
        """Play kubelet + job controller: a pod on `node` (controlled by the Job) that, when `ok`, delivers its items
        to the `--deliver` URL with its upload credential (as `inferscale encode --deliver` does), then a Complete
        (or Failed) status."""
        ns, name, uid = job["metadata"]["namespace"], job["metadata"]["name"], job["metadata"]["uid"]
        if ok:
            deliver(job, self.job_credential(job))
        self.create(f"/api/v1/namespaces/{ns}/pods", {
            "metadata": {"name": f"{name}-x1", "namespace": ns,
                         "labels": {"job-name": name, "batch.kubernetes.io/controller-uid": uid},
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid,
                                              "controller": True}]},
            "spec": {"nodeName": node, "containers": job["spec"]["template"]["spec"]["containers"]},
            "status": {"phase": "Succeeded" if ok else "Failed"},
        })
        cond = ({"type": "Complete", "status": "True"} if ok else
                {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                 "message": "Container encode exited with code 2: bad item m9"})
        self.patch(f"/apis/batch/v1/namespaces/{ns}/jobs/{name}/status",
                   {"status": {"succeeded" if ok else "failed": 1, "conditions": [cond]}})

    def job_credential(self, job: dict[str, Any]) -> str:
        """The upload credential the Job's pod would read: its own Secret's key, or its template's annotation."""
        tmpl = job["spec"]["template"]
        cred = (tmpl["metadata"].get("annotations") or {}).get("inferscale.io/upload-credential")
        if cred:
            return cred
        secret = self.get(f"/api/v1/namespaces/{job['metadata']['namespace']}/secrets/{job['metadata']['name']}")
        return ((secret or {}).get("stringData") or {}).get("upload-credential", "")

    def events(self, ns: str = TENANT) -> list[dict[str, Any]]:
        return self.list(f"/api/v1/namespaces/{ns}/events")

    def add_serving_pod(self, standin: ServingPodStandIn, labels: dict[str, str] | None = None,
                        pod_ip: str = "127.0.0.1", annotations: dict[str, str] | None = None) -> None:
        if self.get(f"/api/v1/namespaces/{SERVER_NS}/pods/{standin.pod}") is not None:
            return  # registered already (the `standins` fixture does)
        self.create("/api/v1/nodes", {"metadata": {"name": standin.node, "labels": {
            "kubernetes.io/hostname": standin.node, **(labels or {})}}})
        self.create(f"/api/v1/namespaces/{SERVER_NS}/pods", {
            "metadata": {"name": standin.pod, "namespace": SERVER_NS,
                         "labels": {"app.kubernetes.io/name": "inferscale", "app.kubernetes.io/component": "server"},
                         "annotations": {"inferscale.io/endpoint": standin.endpoint, **(annotations or {})}},
            "spec": {"nodeName": standin.node, "containers": [{"name": "server", "image": "inferscale"}]},
            "status": {"phase": "Running", "podIP": pod_ip,
                       "conditions": [{"type": "Ready", "status": "True"}]},
        })


@pytest.fixture()
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    emu = EmulatorThread().start()
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": emu.url}}],
        "users": [{"name": "kmock", "user": {"token": "kmock"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    for var, value in {
        "INFERSCALE_SERVER_NAMESPACE": "",
        "INFERSCALE_TENANTS": f"{TENANT},globex",
        "INFERSCALE_JOB_NAMESPACE": JOB_NS,
        "INFERSCALE_INTERNAL_TOKEN": TOKEN,
        "INFERSCALE_ENCODER_IMAGE": "inferscale:test",
        "INFERSCALE_ENCODER_NODE_SELECTOR": json.dumps({"nvidia.com/gpu.present": "true"}),
        "INFERSCALE_ENCODER_TOLERATIONS": json.dumps([{"key": "nvidia.com/gpu", "operator": "Exists",
                                                        "effect": "NoSchedule"}]),
        "INFERSCALE_ENCODER_GPUS": "1",
        "INFERSCALE_MODELS": "gemma-3-270m,tiny-test",
        "INFERSCALE_RECHECK_SECONDS": "1",
        "INFERSCALE_JOB_POLL_SECONDS": "0.2",
        "INFERSCALE_HTTP_TIMEOUT_SECONDS": "3",
    }.items():
        monkeypatch.setenv(var, value)
    c = Cluster(emu)
    try:
        yield c
    finally:
        c.http.close()
        emu.stop()


@pytest.fixture()
def standins(cluster: Cluster) -> Iterator[list[ServingPodStandIn]]:
    """Two serving pods, registered in the cluster: an encode Job needs one to deliver to."""
    with serving_pods(2) as pods:
        for s in pods:
            cluster.add_serving_pod(s)
        yield pods


@contextlib.contextmanager
def running_operator() -> Iterator[KopfRunner]:
    """The real operator, as `kopf run --standalone -A -m inferscale.operator` would start it."""
    from inferscale.operator import Settings, register

    registry = register(kopf.OperatorRegistry(), Settings.from_env())
    with KopfRunner(["run", "--standalone", "-A", "--verbose", "-m", "inferscale.operator"],
                    registry=registry, timeout=20) as runner:
        yield runner


@pytest.fixture()
def operator(cluster: Cluster) -> Iterator[KopfRunner]:
    with running_operator() as runner:
        yield runner
