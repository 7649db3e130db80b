"""The CRD and the trust boundary on a real control plane (issue 19): what KMock and `kubernetes-validate` cannot see.

On real etcd + kube-apiserver + kube-controller-manager (controlplane.py), with charts/inferscale installed by
`helm install` (its CRD included) and RBAC in force:
- both copies of the CRD are accepted, and the API server itself enforces their rules: the id pattern, no `..`,
  the immutable userId, the size bounds, no undeclared fields (field validation Strict);
- a privileged pod in a tenant namespace is refused by Pod Security (`restricted`); so is a hostPath pod in the
  release namespace, which the chart labels `restricted` (issue 24 #1), while the chart's own pods and an encode Job
  of the operator's making are admitted there;
- a tenant identity (bound only in its namespace) cannot read the platform's Secrets, Jobs or records, nor the
  other tenant's UserMemory objects;
- the operator's ServiceAccount token reads no Secret the chart does not grant it;
- the garbage collector removes what a UserMemory, or a Job, owns.
"""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import time
from typing import Any

import httpx
import pytest

from controlplane import start_for_tests
from e2e_common import ROOT, wait_for
from platform_install import JOBS_NAMESPACE, NAMESPACE, TENANTS, Platform

A, B = TENANTS
UM_PATH = "/apis/inferscale.io/v1alpha1/namespaces/{ns}/usermemories"
GOOD = {"apiVersion": "inferscale.io/v1alpha1", "kind": "UserMemory", "metadata": {"name": "caroline"},
        "spec": {"userId": "caroline", "model": "tiny-e2e",
                 "memories": [{"id": "m1", "text": "Caroline researches adoption agencies."}]}}


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    cp = start_for_tests(tmp_path_factory.mktemp("control-plane"))
    try:
        yield Platform(cp).install("--set", "operator.readTenantSecrets=false")
    finally:
        cp.stop()


def _um(name: str = "caroline", **spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(GOOD)
    obj["metadata"]["name"] = name
    obj["spec"].update(spec)
    return obj


def _tenant(platform: Platform, tenant: str = A) -> httpx.Client:
    return platform.cp.client(platform.tenant_kubeconfigs[tenant])


def _refused(resp: httpx.Response, code: int, *needles: str) -> None:
    assert resp.status_code == code, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    for needle in needles:
        assert needle in resp.text, resp.text


# -- the CRD --------------------------------------------------------------------------------------------------------
def test_the_real_server_accepts_both_crds(platform: Platform) -> None:
    with platform.cp.client() as c:
        crd = c.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/usermemories.inferscale.io").json()
    conditions = {cond["type"]: cond["status"] for cond in crd["status"]["conditions"]}
    # helm installed the chart's copy; the top-level copy (the README's first command) passes the server's own checks
    assert conditions.get("Established") == "True" and conditions.get("NonStructuralSchema") is None, conditions
    for path in (ROOT / "crds/usermemory.yaml", ROOT / "charts/inferscale/crds/usermemory.yaml"):
        proc = platform.kubectl("apply", "--dry-run=server", "-f", str(path))
        assert "usermemories.inferscale.io" in proc.stdout


@pytest.mark.parametrize("spec, needle", [
    ({"userId": "a..b"}, "userId must not contain '..'"),
    ({"userId": "../etc"}, "spec.userId"),
    ({"userId": "x" * 129}, "spec.userId"),
    ({"memories": [{"id": "m..1", "text": "t"}]}, "an item id must not contain '..'"),
    ({"memories": [{"id": "bad id", "text": "t"}]}, "spec.memories[0].id"),
    ({"memories": [{"id": "m1", "text": "x" * 8193}]}, "spec.memories[0].text"),
    ({"memories": [{"id": f"m{i}", "text": "t"} for i in range(501)]}, "spec.memories"),
    ({"memoriesFrom": {}, "memories": None}, "spec.memoriesFrom"),
    ({"placement": {"replicas": 17}}, "spec.placement.replicas"),
], ids=["dotdot-user", "climbing-user", "long-user", "dotdot-item", "bad-item", "long-text", "too-many", "empty-from",
        "replicas"])
def test_the_server_refuses_a_bad_spec(platform: Platform, spec: dict[str, Any], needle: str) -> None:
    obj = _um("bad")
    obj["spec"].update(spec)
    obj["spec"] = {k: v for k, v in obj["spec"].items() if v is not None}
    with _tenant(platform) as c:
        _refused(c.post(UM_PATH.format(ns=A), json=obj), 422, needle)


def test_user_id_is_immutable_and_the_rest_is_not(platform: Platform) -> None:
    with _tenant(platform) as c:
        assert c.post(UM_PATH.format(ns=A), json=_um("immutable")).status_code == 201
        url = UM_PATH.format(ns=A) + "/immutable"
        merge = {"Content-Type": "application/merge-patch+json"}
        _refused(c.patch(url, headers=merge, json={"spec": {"userId": "someone-else"}}), 422, "userId is immutable")
        resp = c.patch(url, headers=merge, json={"spec": {"model": "other-model"}})
        assert resp.status_code == 200 and resp.json()["spec"]["model"] == "other-model", resp.text
        assert c.delete(url).status_code == 200


def test_undeclared_fields_are_refused_or_pruned(platform: Platform) -> None:
    """No `additionalProperties: false` in a structural schema: Strict field validation refuses, the default prunes."""
    obj = _um("extra")
    obj["spec"]["memories"][0]["extra"] = 1
    obj["spec"]["placement"] = {"replicas": 1, "zone": "a"}
    proc = platform.kubectl("apply", "-n", A, "-f", "-", kubeconfig=platform.tenant_kubeconfigs[A], check=False,
                            stdin=json.dumps(obj))
    assert proc.returncode != 0 and "unknown field" in proc.stderr, proc.stderr
    with _tenant(platform) as c:
        resp = c.post(UM_PATH.format(ns=A), json=obj, params={"fieldValidation": "Ignore"})
        assert resp.status_code == 201, resp.text
        spec = resp.json()["spec"]
        assert "extra" not in spec["memories"][0] and spec["placement"] == {"replicas": 1}, spec
        c.delete(UM_PATH.format(ns=A) + "/extra")


# -- Pod Security -----------------------------------------------------------------------------------------------------
def test_a_privileged_pod_in_a_tenant_namespace_is_refused(platform: Platform) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "escape"},
           "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {"privileged": True}}],
                    "volumes": [{"name": "host", "hostPath": {"path": "/"}}]}}
    # As cluster admin: RBAC would let it through, so the refusal is Pod Security's.
    with platform.cp.client() as c:
        _refused(c.post(f"/api/v1/namespaces/{A}/pods", json=pod), 403, "violates PodSecurity", "restricted",
                 "privileged", "hostPath")


RESTRICTED = {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@pytest.mark.parametrize("namespace", [NAMESPACE, JOBS_NAMESPACE], ids=["release", "jobs"])
def test_the_release_and_jobs_namespaces_enforce_restricted(platform: Platform, namespace: str) -> None:
    """Issue 24 #1: the namespace holding the KEK, the internal token, the peer secret and the API key hashes
    carries the enforce label (the installer's), and so does the Jobs' own namespace, which the chart creates by
    default (encoder.namespace) and which holds no platform Secret."""
    with platform.cp.client() as c:
        ns = c.get(f"/api/v1/namespaces/{namespace}").json()
        secrets = c.get(f"/api/v1/namespaces/{namespace}/secrets").json()["items"]
    assert ns["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") == "restricted", ns["metadata"]
    if namespace == JOBS_NAMESPACE:
        assert [s["metadata"]["name"] for s in secrets if s.get("type") != "kubernetes.io/service-account-token"] == []


def test_a_host_path_pod_in_the_release_namespace_is_refused(platform: Platform) -> None:
    """Before issue 24 #1 the release namespace had no enforce label: this pod, otherwise restricted, was admitted."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "reads-the-node"},
           "spec": {"securityContext": RESTRICTED,
                    "containers": [{"name": "c", "image": "inferscale", "securityContext": CONTAINER_RESTRICTED,
                                    "volumeMounts": [{"name": "kv", "mountPath": "/kv"}]}],
                    "volumes": [{"name": "kv", "hostPath": {"path": "/var/lib/inferscale/kv"}}]}}
    with platform.cp.client() as c:  # as cluster admin: the refusal is Pod Security's, not RBAC's
        _refused(c.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=pod), 403, "violates PodSecurity",
                 "restricted", "hostPath")


def test_the_charts_pods_and_an_encode_job_are_admitted(platform: Platform) -> None:
    """Every workload of the chart got its pods past Pod Security `restricted` (no FailedCreate), and so does an
    encode Job exactly as the operator makes it in the chart's layout (operator/jobs.py: in the Jobs' namespace,
    its tenant's keys and credential from a Secret of its own, which the operator holds the KEK to derive)."""
    from inferscale.operator import jobs
    from inferscale.operator.settings import Settings

    cfg = Settings(job_namespace=JOBS_NAMESPACE, encoder_gpus=0, kek_file="/var/run/inferscale/kek/kek",
                   encoder_image="inferscale")
    to = jobs.Delivery("http://10.0.0.1:8001/internal/v1/ingest/tenant-a/caroline", f"{NAMESPACE}/s-0", "n")
    job = jobs.job_manifest("tenant-a-caroline-enc-0123456789", A, "caroline", "uid-1", "caroline", "tiny-e2e",
                            ["m1"], cfg, to, "isu1.claims.mac")
    job["spec"]["template"]["spec"]["tolerations"] = [{**ONLY_THIS_TEST, "operator": "Equal"}]  # run by no node
    secrets = [v["secret"]["secretName"] for v in job["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert set(secrets) == {"tenant-a-caroline-enc-0123456789"}, "its own key Secret, never the KEK's"
    with platform.cp.client() as c:
        assert c.post(f"/apis/batch/v1/namespaces/{JOBS_NAMESPACE}/jobs", json=job).status_code == 201
        for component, ns in (("server", NAMESPACE), ("operator", NAMESPACE), ("encode", JOBS_NAMESPACE)):
            sel = (f"app.kubernetes.io/component={component}" if component != "encode"
                   else "job-name=tenant-a-caroline-enc-0123456789")
            wait_for(lambda: c.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": sel})
                     .json()["items"], 90, f"a {component} pod admitted", platform.cp.diag)
        events = [e for ns in (NAMESPACE, JOBS_NAMESPACE) for e in c.get(f"/api/v1/namespaces/{ns}/events")
                  .json()["items"]]
        refused = [e["message"] for e in events if e.get("reason") == "FailedCreate"]
        assert not refused, refused
        c.request("DELETE", f"/apis/batch/v1/namespaces/{JOBS_NAMESPACE}/jobs/tenant-a-caroline-enc-0123456789",
                  json={"propagationPolicy": "Background"})


# -- RBAC: tenants ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [
    f"/api/v1/namespaces/{NAMESPACE}/secrets",
    f"/api/v1/namespaces/{NAMESPACE}/secrets/inferscale-internal",
    f"/api/v1/namespaces/{NAMESPACE}/secrets/inferscale-kek",
    f"/api/v1/namespaces/{NAMESPACE}/secrets/inferscale-tls-ca",
    f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs",
    f"/api/v1/namespaces/{NAMESPACE}/configmaps",
    f"/api/v1/namespaces/{NAMESPACE}/pods",
    f"/apis/batch/v1/namespaces/{JOBS_NAMESPACE}/jobs",
    f"/api/v1/namespaces/{JOBS_NAMESPACE}/configmaps",  # the per-user records and the Jobs' items files
    f"/api/v1/namespaces/{JOBS_NAMESPACE}/secrets",  # the Jobs' key Secrets (each its tenant's derived keys)
    "/api/v1/secrets",
    UM_PATH.format(ns=B),  # the other tenant
], ids=["secrets", "internal-token", "kek", "tls-ca", "jobs", "configmaps", "pods", "jobs-ns-jobs", "records",
        "key-secrets", "all-secrets", "other-tenant"])
@pytest.mark.parametrize("tenant", TENANTS)
def test_a_tenant_cannot_read_the_platform(platform: Platform, tenant: str, path: str) -> None:
    if tenant == B:
        path = path.replace(f"/namespaces/{B}/", f"/namespaces/{A}/")
    with _tenant(platform, tenant) as c:
        _refused(c.get(path), 403, "forbidden")
        # while its own namespace is its own (a 429 "storage is (re)initializing" just after install: retried)
        wait_for(lambda: c.get(UM_PATH.format(ns=tenant)).status_code == 200, 30, f"{tenant} lists its UserMemories")


# -- RBAC: the operator -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [
    "/api/v1/secrets",
    f"/api/v1/namespaces/{NAMESPACE}/secrets",
    f"/api/v1/namespaces/{NAMESPACE}/secrets/inferscale-kek",
    f"/api/v1/namespaces/{NAMESPACE}/secrets/inferscale-tls-ca",  # it mounts ca.crt; the CA's key is nobody's
    f"/api/v1/namespaces/{A}/secrets",
    "/api/v1/namespaces/kube-system/secrets",
], ids=["all", "platform", "kek", "tls-ca", "tenant", "kube-system"])
def test_the_operator_reads_no_secret_the_chart_does_not_grant(platform: Platform, path: str) -> None:
    with platform.cp.client(platform.operator_kubeconfig) as c:
        _refused(c.get(path), 403, "system:serviceaccount:inferscale-system:inferscale-operator")


def test_the_operator_can_do_its_job_and_no_more(platform: Platform) -> None:
    """Issue 24 #1, the chart's default layout: the operator runs its Jobs and keeps its ConfigMaps and key Secrets
    in the Jobs' namespace; where the platform's Secrets are it reads the serving pods and creates nothing."""
    dry = {"dryRun": "All"}
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dry-run"}, "data": {}}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "dry-run"}, "data": {}}
    with platform.cp.client(platform.operator_kubeconfig) as c:
        assert c.get(UM_PATH.format(ns=A)).status_code == 200
        assert c.get(f"/apis/batch/v1/namespaces/{JOBS_NAMESPACE}/jobs").status_code == 200
        assert c.get(f"/api/v1/namespaces/{NAMESPACE}/pods").status_code == 200
        job = _job("dry-run")
        for kind, obj in (("batch/v1/namespaces/{ns}/jobs", job), ("v1/namespaces/{ns}/configmaps", cm),
                          ("v1/namespaces/{ns}/secrets", secret)):
            root = "/apis" if kind.startswith("batch") else "/api"
            assert c.post(f"{root}/{kind.format(ns=JOBS_NAMESPACE)}", params=dry, json=obj).status_code == 201
            # ... but not where the platform's Secrets are (a Job there could mount any of them)
            _refused(c.post(f"{root}/{kind.format(ns=NAMESPACE)}", params=dry, json=obj), 403)
        _refused(c.get(f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"), 403)
        # ... nor run a Job in a tenant namespace, nor create UserMemory objects for a tenant
        _refused(c.post(f"/apis/batch/v1/namespaces/{A}/jobs", params=dry, json=job), 403)
        _refused(c.post(UM_PATH.format(ns=A), params=dry, json=_um()), 403)


# -- the garbage collector --------------------------------------------------------------------------------------------
def _job(name: str) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"suspend": True, "template": {"spec": {"restartPolicy": "Never", "securityContext": RESTRICTED,
                                                            "containers": [
                {"name": "c", "image": "inferscale", "command": ["true"], "securityContext": CONTAINER_RESTRICTED}]}}}}


def _gone(c: httpx.Client, path: str) -> bool:
    return c.get(path).status_code == 404


def test_deleting_a_usermemory_collects_what_it_owns(platform: Platform) -> None:
    with _tenant(platform) as c:
        um = c.post(UM_PATH.format(ns=A), json=_um("owner")).json()
        owner = {"apiVersion": "inferscale.io/v1alpha1", "kind": "UserMemory", "name": "owner",
                 "uid": um["metadata"]["uid"]}
        cm = {"metadata": {"name": "owned", "ownerReferences": [owner]}, "data": {"k": "v"}}
        assert c.post(f"/api/v1/namespaces/{A}/configmaps", json=cm).status_code == 201
        assert c.delete(UM_PATH.format(ns=A) + "/owner").status_code == 200
        wait_for(lambda: _gone(c, f"/api/v1/namespaces/{A}/configmaps/owned"), 90,
                 "the garbage collector to remove the ConfigMap the UserMemory owned", platform.cp.diag)


def test_deleting_a_job_collects_its_items_configmap(platform: Platform) -> None:
    """The operator's items ConfigMap, made before its Job, is then owned by it (operator/jobs.py: the same merge
    patch the operator sends): the real GC removes it with the Job."""
    from inferscale.operator.jobs import configmap_manifest, owner_reference
    from inferscale.operator.settings import Settings
    from inferscale.operator.spec import Item

    with platform.cp.client() as c:
        settings = Settings(job_namespace=JOBS_NAMESPACE)
        cm = configmap_manifest("enc-gc-items", settings, A, "caroline", "uid-1", [Item(id="m1", text="t")])
        assert c.post(f"/api/v1/namespaces/{JOBS_NAMESPACE}/configmaps", json=cm).status_code == 201
        job = c.post(f"/apis/batch/v1/namespaces/{JOBS_NAMESPACE}/jobs", json=_job("enc-gc")).json()
        resp = c.patch(f"/api/v1/namespaces/{JOBS_NAMESPACE}/configmaps/enc-gc-items", json=owner_reference(job),
                       headers={"Content-Type": "application/merge-patch+json"})
        assert resp.status_code == 200, resp.text
        resp = c.request("DELETE", f"/apis/batch/v1/namespaces/{JOBS_NAMESPACE}/jobs/enc-gc",
                         json={"propagationPolicy": "Background"})
        assert resp.status_code == 200, resp.text
        started = time.monotonic()
        wait_for(lambda: _gone(c, f"/api/v1/namespaces/{JOBS_NAMESPACE}/configmaps/enc-gc-items"), 90,
                 "the garbage collector to remove the Job's items ConfigMap", platform.cp.diag)
        assert time.monotonic() - started < 90


# -- the scheduler, the Job controller, a node ---------------------------------------------------------------------
# The chart's own pods (operator, server) stay off these nodes: this module checks the API server, not them.
ONLY_THIS_TEST = {"key": "e2e/scheduling-test", "value": "only", "effect": "NoSchedule"}

def test_a_gpu_job_is_scheduled_run_and_completed(platform: Platform, tmp_path) -> None:
    """The real scheduler binds by node selector and `nvidia.com/gpu`; the stand-in runs the pod; the real Job
    controller marks the Job Complete."""
    from kubelet_standin import KubeletStandIn

    nodes = [KubeletStandIn(platform.cp, name, ip=ip, image_dir=tmp_path, work_dir=tmp_path / name, gpus=gpus,
                            labels=labels, host_root=tmp_path / name / "disk", taints=[ONLY_THIS_TEST]).start()
             for name, ip, gpus, labels in (("cpu-node", "127.0.0.4", 0, {}),
                                            ("gpu-node", "127.0.0.5", 1, {"nvidia.com/gpu.present": "true"}))]
    try:
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "gpu-work"}, "spec": {
            "backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "nodeSelector": {"nvidia.com/gpu.present": "true"},
                "tolerations": [{**ONLY_THIS_TEST, "operator": "Equal"}], "securityContext": RESTRICTED,
                "volumes": [{"name": "out", "emptyDir": {}}],  # the release namespace admits no hostPath
                "containers": [{"name": "c", "image": "inferscale", "securityContext": CONTAINER_RESTRICTED, "env": [
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                    "command": ["python", "-c", "import os, sys; open(sys.argv[1], 'w').write(os.environ['NODE'])",
                                "/out/ran"],
                    "volumeMounts": [{"name": "out", "mountPath": "/out"}],
                    "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}}}
        with platform.cp.client() as c:
            assert c.post(f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs", json=job).status_code == 201

            def complete() -> dict[str, Any] | None:
                got = c.get(f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/gpu-work").json()
                done = {cond["type"] for cond in (got.get("status") or {}).get("conditions") or []
                        if cond["status"] == "True"}
                assert "Failed" not in done, got["status"]
                return got if "Complete" in done else None

            wait_for(complete, 120, "the Job controller to mark the Job Complete",
                     lambda: f"{platform.cp.diag()}\nstand-in errors: {[n.errors[-3:] for n in nodes]}")
            pods = c.get(f"/api/v1/namespaces/{NAMESPACE}/pods", params={"labelSelector": "job-name=gpu-work"}).json()
            assert [p["spec"]["nodeName"] for p in pods["items"]] == ["gpu-node"]
        assert [p.read_text() for p in (tmp_path / "gpu-node").glob("pods/*/volumes/out/ran")] == ["gpu-node"]
        assert not list((tmp_path / "cpu-node").glob("pods/*/volumes/out/ran"))
    finally:
        for n in nodes:
            n.stop()


# -- TLS (issue 24, finding 9): rotation by re-rendering ------------------------------------------------------------
def test_an_upgrade_issues_a_new_fleet_certificate_under_the_kept_ca(platform: Platform) -> None:
    """The chart looks its CA up on the real API server and keeps it; every render issues a new server
    certificate, signed by that CA, so pods holding either certificate still trust each other."""
    from cryptography import x509

    def tls() -> dict[str, str]:
        with platform.cp.client() as c:
            resp = c.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/inferscale-tls")
            assert resp.status_code == 200, resp.text
            return resp.json()["data"]

    before = tls()
    proc = subprocess.run([platform.helm_bin, "--kubeconfig", str(platform.cp.admin_kubeconfig), "upgrade",
                           "inferscale", str(ROOT / "charts" / "inferscale"), "-n", NAMESPACE,
                           "-f", str(ROOT / "charts/inferscale/values-cpu.yaml"),
                           "--set", f"internalToken.value={platform.internal_token}",
                           "--set-json", "tenants=" + json.dumps(list(TENANTS)),
                           "--set", "operator.readTenantSecrets=false"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"helm upgrade: {proc.stdout}{proc.stderr}"
    after = tls()
    assert after["ca.crt"] == before["ca.crt"] and after["tls.crt"] != before["tls.crt"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(after["ca.crt"]))
    for data in (before, after):
        x509.load_pem_x509_certificate(base64.b64decode(data["tls.crt"])).verify_directly_issued_by(ca)
