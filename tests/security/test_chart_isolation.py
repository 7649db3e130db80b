"""Chart side of tenant isolation (issue 11): what `helm template` of every values file must and must not render."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chart"))
import test_chart as chart  # noqa: E402  (its helpers: helm, render, one, workload, container, _validate_all)

RELEASE_NS = "inferscale"
TENANTS = ("acme", "globex")
VARIANTS = [(v, ("tenants={acme,globex}",)) for v in chart.VALUES_FILES] + [
    ("values.yaml", ("tenants={acme,globex}", "operator.readTenantSecrets=true", "server.kind=DaemonSet"))]


def rendered(values: str, sets: tuple[str, ...]) -> list[dict[str, Any]]:
    return chart.docs(values, sets=sets, namespace=RELEASE_NS)


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    tmpl = (obj.get("spec") or {}).get("template")
    return (tmpl or {}).get("spec") if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job") else None


@pytest.mark.parametrize("values,sets", VARIANTS)
def test_no_host_path_in_a_tenant_namespace_and_validates(values: str, sets: tuple[str, ...]) -> None:
    m = rendered(values, sets)
    chart._validate_all(tuple(m))  # kubernetes-validate --strict
    for obj in m:
        ns = obj["metadata"].get("namespace")
        if ns in TENANTS:
            assert obj["kind"] in ("Role", "RoleBinding"), f"only the operator's RBAC goes to a tenant: {obj['kind']}"
        spec = pod_spec(obj)
        if spec is not None:
            assert ns == RELEASE_NS
    in_tenants = [o for o in m if o["metadata"].get("namespace") in TENANTS]
    assert "hostPath" not in json.dumps(in_tenants)


@pytest.mark.parametrize("values,sets", VARIANTS)
def test_network_policy_guards_the_internal_and_peer_ports(values: str, sets: tuple[str, ...]) -> None:
    m = rendered(values, sets)
    server = chart.workload(m, "server")
    ports = {p["name"]: p["containerPort"] for p in chart.container(server)["ports"]}
    assert (ports["http"], ports["internal"], ports["nixl"]) == (8000, 8001, 5555)
    assert {p for n, p in ports.items() if n.startswith("ucx-")} == set(range(5556, 5600))
    svc = chart.one(m, "Service", "inferscale")
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"], "the tenant Service exposes only 8000"
    pol = next(p for p in m if p["kind"] == "NetworkPolicy"
               and p["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "server")
    assert pol["spec"]["policyTypes"] == ["Ingress", "Egress"]
    by_port = {r["ports"][0]["port"]: r for r in pol["spec"]["ingress"]}
    assert set(by_port) == {8000, 8001, 5555}
    assert "from" not in by_port[8000]  # tenant API: open by default (networkPolicy.tenantApiFrom restricts it)
    op_peer, job_peer = by_port[8001]["from"]  # the operator, and the encode Jobs' deliveries: that port only
    assert op_peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert job_peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "inferscale-operator",
                                                      "inferscale.io/role": "encode"}
    assert len(by_port[8001]["ports"]) == 1
    (srv_peer,) = by_port[5555]["from"]
    assert srv_peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "server"
    assert {"port": 5556, "endPort": 5599, "protocol": "TCP"} in by_port[5555]["ports"]
    env = chart.effective_env(m, server)
    assert (env["INFERSCALE_INTERNAL_PORT"], env["INFERSCALE_UCX_PORT_RANGE"]) == ("8001", "5556-5599")
    assert env["INFERSCALE_PEER_SECRET_FILE"] == "/var/run/inferscale/internal/peer-secret"


def _policy_for(m: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, Any]:
    """The one NetworkPolicy whose podSelector matches a pod with these labels."""
    (pol,) = [p for p in m if p["kind"] == "NetworkPolicy"
              and all(labels.get(k) == v for k, v in p["spec"]["podSelector"]["matchLabels"].items())]
    return pol


def _egress_ports(pol: dict[str, Any]) -> set[tuple[str, int]]:
    return {(p["protocol"], p["port"]) for rule in pol["spec"].get("egress") or [] for p in rule["ports"]}


@pytest.mark.parametrize("values,sets", VARIANTS)
def test_egress_is_denied_but_for_what_each_pod_needs(values: str, sets: tuple[str, ...]) -> None:
    """Issue 24 #3: default-deny egress for servers, Jobs and the operator (checkov CKV2_K8S_6: every pod has a
    policy), each allowed only DNS, the API server (operator), the peer ports (servers) and the internal port."""
    from inferscale.operator import jobs
    from inferscale.operator.settings import Settings

    m = rendered(values, sets)
    for obj in m:
        if pod_spec(obj) is not None:
            pol = _policy_for(m, obj["spec"]["template"]["metadata"]["labels"])
            assert "Egress" in pol["spec"]["policyTypes"], f"{obj['kind']} {obj['metadata']['name']}: egress open"
    server = _policy_for(m, chart.workload(m, "server")["spec"]["template"]["metadata"]["labels"])
    assert _egress_ports(server) == {("UDP", 53), ("TCP", 53), ("TCP", 5555), ("TCP", 5556)}
    peer_rule = next(r for r in server["spec"]["egress"] if r["ports"][0]["port"] == 5555)
    assert [t["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for t in peer_rule["to"]] == ["server"]
    op = _policy_for(m, chart.workload(m, "operator")["spec"]["template"]["metadata"]["labels"])
    assert _egress_ports(op) == {("UDP", 53), ("TCP", 53), ("TCP", 443), ("TCP", 6443), ("TCP", 8001)}
    internal = next(r for r in op["spec"]["egress"] if r["ports"][0]["port"] == 8001)
    assert [t["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for t in internal["to"]] == ["server"]
    # The operator's Jobs (rendered by its own code) fall under the Jobs' policy: no ingress; egress only to the
    # serving pods' internal port (their delivery), no DNS.
    to = jobs.Delivery("http://10.0.0.1:8001/internal/v1/ingest/acme/u", "ns/s-0", "n")
    job = jobs.job_manifest("j", "acme", "u", "uid", "u", "gemma-3-270m", ["a"], Settings(), to, "isu1.c.m")
    pol = _policy_for(m, job["spec"]["template"]["metadata"]["labels"])
    assert pol["spec"]["policyTypes"] == ["Ingress", "Egress"] and not pol["spec"].get("ingress")
    assert _egress_ports(pol) == {("TCP", 8001)}
    (rule,) = pol["spec"]["egress"]
    assert [t["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for t in rule["to"]] == ["server"]


def test_tenant_api_can_be_restricted() -> None:
    m = chart.docs("values.yaml", sets=("networkPolicy.tenantApiFrom[0].namespaceSelector.matchLabels.team=ai",))
    pol = chart.one(m, "NetworkPolicy", "-server")
    tenant_rule = next(r for r in pol["spec"]["ingress"] if r["ports"][0]["port"] == 8000)
    assert tenant_rule["from"] == [{"namespaceSelector": {"matchLabels": {"team": "ai"}}}]


@pytest.mark.parametrize("values,sets", VARIANTS)
def test_pdb_and_namespaced_rbac_and_no_cluster_rule_on_secrets(values: str, sets: tuple[str, ...]) -> None:
    m = rendered(values, sets)
    pdb = chart.one(m, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "server"
    assert pdb["spec"]["maxUnavailable"] == 1
    for cr in (o for o in m if o["kind"] == "ClusterRole"):
        assert not any("secrets" in r["resources"] or "*" in r["resources"] for r in cr["rules"])
    roles = {o["metadata"]["namespace"] for o in m if o["kind"] == "Role"}
    assert roles == {RELEASE_NS, f"{RELEASE_NS}-jobs", *TENANTS}
    op_env = chart.effective_env(m, chart.workload(m, "operator"))
    assert op_env["INFERSCALE_TENANTS"] == "acme,globex" and op_env["INFERSCALE_JOB_NAMESPACE"] == f"{RELEASE_NS}-jobs"
    args = chart.container(chart.workload(m, "operator"))["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=acme", "--namespace=globex"]


@pytest.mark.parametrize("values,sets", VARIANTS)
def test_nothing_asks_for_privileged(values: str, sets: tuple[str, ...]) -> None:
    text = chart.helm(*chart.template_args(values, sets=sets, namespace=RELEASE_NS)).stdout
    assert "privileged" not in text.lower()
    for obj in rendered(values, sets):
        spec = pod_spec(obj)
        for c in [*(spec or {}).get("containers", []), *(spec or {}).get("initContainers", [])]:
            assert not (c.get("securityContext") or {}).get("privileged")
            assert (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is False


def test_chart_readme_does_not_ask_tenants_for_privileged() -> None:
    readme = (chart.CHART / "README.md").read_text()
    assert "privileged" not in readme.lower(), "tenant namespaces stay at Pod Security `restricted`"
    assert "restricted" in readme


# Pod Security `restricted` volume kinds (issue 24 #1: no hostPath anywhere, so the namespaces can enforce it).
RESTRICTED_VOLUMES = {"configMap", "secret", "emptyDir", "projected", "persistentVolumeClaim", "ephemeral",
                      "downwardAPI", "csi"}


def _restricted_problems(spec: dict[str, Any]) -> list[str]:
    """What of Pod Security `restricted` a pod spec violates: its volumes, and per container."""
    pod_sc = spec.get("securityContext") or {}
    out = [f"volume {v['name']}: {sorted(set(v) - {'name'})}" for v in spec.get("volumes") or []
           if set(v) - {"name"} - RESTRICTED_VOLUMES]
    for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        sc = c.get("securityContext") or {}
        if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True):
            out.append(f"{c['name']}: runAsNonRoot")
        if (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
            out.append(f"{c['name']}: seccompProfile")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation")
        caps = sc.get("capabilities") or {}
        if caps.get("drop") != ["ALL"] or set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: capabilities")
    return out


@pytest.mark.parametrize("values,sets", VARIANTS)
def test_every_pod_meets_pod_security_restricted(values: str, sets: tuple[str, ...]) -> None:
    from inferscale.operator import jobs
    from inferscale.operator.settings import Settings

    m = rendered(values, sets)
    specs = {f"{o['kind']}/{o['metadata']['name']}": pod_spec(o) or o.get("spec") for o in m
             if pod_spec(o) is not None or o["kind"] == "Pod"}
    to = jobs.Delivery("http://10.0.0.1:8001/internal/v1/ingest/acme/u", "ns/s-0", "n")
    for name, cfg in (("encode Job", Settings(kek_secret="k")), ("encode Job, own Secret", Settings(kek_file="/k"))):
        specs[name] = jobs.job_manifest("j", "acme", "u", "uid", "u", "gemma-3-270m", ["a"], cfg, to, "isu1.c.m")[
            "spec"]["template"]["spec"]
    assert len(specs) >= 5
    problems = {name: p for name, spec in specs.items() if (p := _restricted_problems(spec))}
    assert not problems, problems


@pytest.mark.parametrize("values,sets", VARIANTS)
def test_default_jobs_namespace_holds_no_platform_secret_and_release_role_only_reads(
        values: str, sets: tuple[str, ...]) -> None:
    """Issue 24 #1/#2, on a DEFAULT rendering: the Jobs run in <release namespace>-jobs (rendered by the chart), the
    operator may only read pods where the platform Secrets are (no Jobs, ConfigMaps or Secrets to create, update or
    delete), and no Job it builds from the chart's settings mounts the KEK Secret: each gets its tenant's derived keys
    (the operator mounts the KEK itself)."""
    from inferscale.operator import jobs
    from inferscale.operator.settings import Settings

    jobs_ns = f"{RELEASE_NS}-jobs"
    m = rendered(values, sets)
    assert chart.one(m, "Namespace", jobs_ns)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    roles = {o["metadata"]["namespace"]: o for o in m if o["kind"] == "Role"}
    assert set(roles) == {RELEASE_NS, jobs_ns, *TENANTS}
    release_rules = {(g, r): set(rule["verbs"]) for rule in roles[RELEASE_NS]["rules"]
                     for g in rule["apiGroups"] for r in rule["resources"]}
    assert release_rules == {("", "pods"): {"get", "list", "watch"}}, "no Jobs, ConfigMaps or Secrets where the KEK is"
    writes = {"create", "update", "patch", "delete", "deletecollection", "*"}
    assert not [r for r in roles[RELEASE_NS]["rules"] if set(r["verbs"]) & writes]
    job_rules = {r for rule in roles[jobs_ns]["rules"] for r in rule["resources"]}
    assert {"jobs", "pods", "configmaps", "secrets"} <= job_rules
    assert not [o for o in m if o["kind"] == "Secret" and o["metadata"]["namespace"] == jobs_ns]
    op = chart.workload(m, "operator")
    env = chart.effective_env(m, op)
    assert env["INFERSCALE_JOB_NAMESPACE"] == jobs_ns and env["INFERSCALE_KEK_FILE"] == "/var/run/inferscale/kek/kek"
    assert "INFERSCALE_KEK_SECRET" not in env, "Jobs never mount the KEK Secret"
    kek_secret = chart.one(m, "Secret", "-kek")["metadata"]["name"]
    (kek,) = [v for v in op["spec"]["template"]["spec"]["volumes"] if v["name"] == "kek"]
    assert kek["secret"]["secretName"] == kek_secret
    # The operator's settings for its Jobs, as the chart configures them (from_env would also read the mounted files).
    settings = Settings(kek_file=env["INFERSCALE_KEK_FILE"], kek_secret=env.get("INFERSCALE_KEK_SECRET", ""),
                        job_namespace=env["INFERSCALE_JOB_NAMESPACE"])
    to = jobs.Delivery("http://10.0.0.1:8001/internal/v1/ingest/acme/u", "ns/s-0", "n")
    job = jobs.job_manifest("j", "acme", "u", "uid", "u", "gemma-3-270m", ["a"], settings, to, "isu1.c.m")
    secrets = [v["secret"]["secretName"] for v in job["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert secrets and kek_secret not in secrets, f"the Job mounts {secrets}"
    (jobs_policy,) = [p for p in m if p["kind"] == "NetworkPolicy" and p["metadata"]["name"].endswith("-jobs")]
    assert jobs_policy["metadata"]["namespace"] == jobs_ns


def test_jobs_namespace_can_be_named_and_never_be_the_release_or_a_tenant_namespace() -> None:
    """encoder.namespace names the Jobs' namespace; it can be neither a tenant's nor the release namespace (the
    shared layout, where Jobs mounted the KEK Secret, is gone from the chart)."""
    m = rendered("values.yaml", ("tenants={acme,globex}", "encoder.namespace=batch", "encoder.createNamespace=false"))
    assert chart.effective_env(m, chart.workload(m, "operator"))["INFERSCALE_JOB_NAMESPACE"] == "batch"
    assert not [o for o in m if o["kind"] == "Namespace"], "createNamespace=false: the namespace is yours"
    assert {o["metadata"]["namespace"] for o in m if o["kind"] == "Role"} == {RELEASE_NS, "batch", *TENANTS}
    for sets, says in ((("tenants={batch}", "encoder.namespace=batch"), "Jobs' namespace"),
                       ((f"encoder.namespace={RELEASE_NS}",), "encoder.namespace")):
        bad = chart.helm(*chart.template_args("values.yaml", sets=sets, namespace=RELEASE_NS), check=False)
        assert bad.returncode != 0 and says in bad.stderr, bad.stderr
