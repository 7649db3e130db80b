"""Pure parts of the operator: spec parsing, hashing, Job manifests, placement, settings, the CLI."""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest

from inferscale.errors import ConfigError
from inferscale.operator import jobs, placement
from inferscale.operator.cli import main
from inferscale.operator.servers import ServingPod, serving_pods
from inferscale.operator.settings import Settings
from inferscale.operator.spec import Item, SpecError, parse

MODELS = ("gemma-3-270m",)
NOW = datetime.datetime(2025, 6, 1, tzinfo=datetime.timezone.utc)


def no_refs(kind: str, name: str, key: str) -> str:
    raise SpecError("ReferenceNotFound", f"{kind} {name} not found")


def spec(**kw: object) -> dict[str, object]:
    return {"userId": "u1", "model": "gemma-3-270m", "memories": [{"id": "a", "text": "x"}], **kw}


def test_parse_merges_reference_and_inline_items() -> None:
    ref = '{"id": "a", "text": "from ref"}\n\n{"id": "b", "text": "only in ref", "timestamp": "2025-01-01"}\n'
    d = parse(spec(memoriesFrom={"configMapKeyRef": {"name": "cm", "key": "k"}}), MODELS,
              lambda kind, name, key: ref, now=NOW)
    assert d.items == {"a": Item("a", "x"), "b": Item("b", "only in ref", "2025-01-01")}


@pytest.mark.parametrize("bad, reason, text", [
    (spec(model="llama-9000"), "UnknownModel", "llama-9000"),
    (spec(memories=[{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]), "InvalidMemory", "duplicate id 'a'"),
    (spec(memories=[{"id": "a", "text": "   "}]), "InvalidMemory", "empty text"),
    (spec(memoriesFrom={"secretKeyRef": {"name": "s", "key": "k"}}), "ReferenceNotFound", "Secret s"),
])
def test_parse_names_the_problem(bad: dict[str, object], reason: str, text: str) -> None:
    with pytest.raises(SpecError) as e:
        parse(bad, MODELS, no_refs, now=NOW)
    assert e.value.reason == reason and text in e.value.message


def test_malformed_jsonl_names_the_line() -> None:
    bad = '{"id": "a", "text": "ok"}\n{"id": "b", "text": "ok"}\n{"id": "c", "text": "unterminated\n'
    with pytest.raises(SpecError, match=r"ConfigMap cm key k line 3: malformed JSON"):
        parse(spec(memoriesFrom={"configMapKeyRef": {"name": "cm", "key": "k"}}), MODELS,
              lambda *_: bad, now=NOW)


def test_retention_keeps_the_newest() -> None:
    items = [{"id": f"m{i}", "text": "t", "timestamp": f"2025-0{i}-01"} for i in range(1, 6)]
    d = parse(spec(memories=items, retention={"maxItems": 2}), MODELS, no_refs, now=NOW)
    assert list(d.items) == ["m4", "m5"]
    d = parse(spec(memories=items, retention={"maxAgeDays": 70}), MODELS, no_refs, now=NOW)
    assert list(d.items) == ["m4", "m5"]  # 2025-04-01 is 61 days before NOW; 03-01 is 92


def test_hashes_change_with_text_and_model_only() -> None:
    a = parse(spec(), MODELS, no_refs, now=NOW)
    b = parse(spec(placement={"replicas": 3}), MODELS, no_refs, now=NOW)
    c = parse(spec(memories=[{"id": "a", "text": "y"}]), MODELS, no_refs, now=NOW)
    d = parse(spec(model="tiny"), ("gemma-3-270m", "tiny"), no_refs, now=NOW)
    assert a.content_hash() == b.content_hash()
    assert len({a.content_hash(), c.content_hash(), d.content_hash()}) == 3
    assert a.item_hashes()["a"] != d.item_hashes()["a"]


def test_job_name_is_deterministic_and_short() -> None:
    n1 = jobs.job_name("acme", "x" * 253, "uid", "h1", ["b", "a"])
    assert n1 == jobs.job_name("acme", "x" * 253, "uid", "h1", ["a", "b"]) and len(n1) <= 63
    assert n1 != jobs.job_name("acme", "x" * 253, "uid", "h1", ["a"]) != jobs.job_name("acme", "x" * 253, "uid", "h2", ["a"])
    # Jobs of every tenant share the platform namespace: same object name, another tenant or uid, another Job.
    assert n1 != jobs.job_name("globex", "x" * 253, "uid", "h1", ["a", "b"])
    assert n1 != jobs.job_name("acme", "x" * 253, "uid2", "h1", ["a", "b"])


def test_job_phase_and_node() -> None:
    assert jobs.job_phase({}) == ("Running", "")
    assert jobs.job_phase({"status": {"conditions": [{"type": "Complete", "status": "True"}]}})[0] == "Succeeded"
    failed = {"status": {"conditions": [{"type": "Failed", "status": "True", "message": "exit 2"}]}}
    assert jobs.job_phase(failed) == ("Failed", "exit 2")
    job = encode_job(Settings())
    assert jobs.delivered_to(job) == ("sys/server-0", "node-0"), "where it delivers: the operator's own annotations"


DELIVERY = jobs.Delivery("http://10.0.0.1:8001/internal/v1/ingest/t/u", "sys/server-0", "node-0")


def encode_job(cfg: Settings, ids: tuple[str, ...] = ("a",)) -> dict:
    return jobs.job_manifest("j", "t", "u", "uid-1", "u", "gemma-3-270m", list(ids), cfg, DELIVERY, "isu1.x.y")


def test_cpu_cluster_job_requests_no_gpu() -> None:
    m = encode_job(Settings(encoder_gpus=0))
    assert "nvidia.com/gpu" not in str(m["spec"]["template"]["spec"]["containers"][0]["resources"])


def test_encode_job_writes_the_fleet_kv_dtype() -> None:
    command = lambda cfg: encode_job(cfg)["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--kv-dtype" not in command(Settings())  # bf16: the encoder's default
    cfg = Settings.from_env({"INFERSCALE_KV_DTYPE": "int8"})
    assert command(cfg)[-2:] == ["--kv-dtype", "int8"]
    with pytest.raises(ConfigError, match="INFERSCALE_KV_DTYPE"):
        Settings.from_env({"INFERSCALE_KV_DTYPE": "int3"})


def pod(name: str, node: str) -> ServingPod:
    return ServingPod(name=name, namespace="ns", node=node, endpoint=f"http://{name}", peer=None)


def test_placement_spreads_prefers_free_and_is_stable() -> None:
    pods = [pod("a", "n1"), pod("b", "n1"), pod("c", "n2"), pod("d", "n3")]
    free = {"ns/a": 100, "ns/b": 500, "ns/c": 10, "ns/d": 50}
    chosen = placement.choose(2, pods, [], free)
    assert [p.name for p in chosen] == ["b", "d"]  # most free, then most free on another node
    assert [p.name for p in placement.choose(2, pods, ["ns/c"], free)] == ["c", "b"]  # c stays
    assert [p.name for p in placement.choose(3, pods[:2], [], free)] == ["b", "a"]  # fewer pods than replicas
    assert placement.choose(1, pods, ["ns/gone"], free)[0].name == "b"


def test_serving_pods_skip_unready_and_find_endpoints() -> None:
    def raw(name: str, ready: str, phase: str = "Running", **meta: object) -> dict[str, object]:
        return {"metadata": {"name": name, "namespace": "ns", **meta}, "spec": {"nodeName": "n"},
                "status": {"phase": phase, "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": ready}]}}
    pods = serving_pods([raw("a", "True"), raw("b", "False"), raw("c", "True", "Pending"),
                         raw("d", "True", annotations={"inferscale.io/endpoint": "http://x:1/"})], 8000)
    assert [(p.name, p.endpoint) for p in pods] == [("a", "http://10.0.0.1:8000"), ("d", "http://x:1")]
    assert [p.name for p in serving_pods([raw("b", "False")], 8000, require_ready=False)] == ["b"]


def test_settings_from_env() -> None:
    s = Settings.from_env({"INFERSCALE_MODELS": "a, b", "INFERSCALE_ENCODER_NODE_SELECTOR": '{"gpu": "yes"}',
                           "INFERSCALE_ENCODER_GPUS": "0", "INFERSCALE_INTERNAL_PORT": "9001",
                           "INFERSCALE_TENANTS": "acme, globex"})
    assert s.models == ("a", "b") and s.encoder_node_selector == {"gpu": "yes"}
    assert (s.encoder_gpus, s.internal_port, s.encoder_out_size) == (0, 9001, "4Gi")
    assert s.tenants == ("acme", "globex") and not s.read_tenant_secrets
    with pytest.raises(ConfigError, match="INFERSCALE_TENANTS"):
        Settings.from_env({"INFERSCALE_TENANTS": "acme,../x"})
    with pytest.raises(ConfigError, match="INFERSCALE_JOB_NAMESPACE"):
        Settings.from_env({"INFERSCALE_TENANTS": "acme", "INFERSCALE_JOB_NAMESPACE": "acme"})
    with pytest.raises(ConfigError, match="INFERSCALE_ENCODER_TOLERATIONS"):
        Settings.from_env({"INFERSCALE_ENCODER_TOLERATIONS": '{"not": "a list"}'})


def test_main_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--encoder-gpus", "-1"]) == 2
    assert "INFERSCALE_ENCODER_GPUS" in capsys.readouterr().err


def test_operator_imports_no_model_code() -> None:
    code = ("import sys, inferscale.operator; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy') "
            "or m.startswith(('inferscale.engine', 'inferscale.models'))]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_an_encode_job_mounts_no_host_path_and_delivers_with_its_credential() -> None:
    """Issue 24 finding 1: Pod Security `restricted` forbids hostPath; the Job writes to its own emptyDir and
    delivers, with its credential from its own Secret (kek_file) or its pod's annotation (beside the platform)."""
    for cfg in (Settings(kek_secret="kek"), Settings(kek_file="/k")):
        job = encode_job(cfg)
        spec = job["spec"]["template"]["spec"]
        kinds = {next(k for k in v if k != "name") for v in spec["volumes"]}
        assert kinds <= {"configMap", "secret", "emptyDir", "downwardAPI"}, kinds
        assert not spec.get("initContainers"), "no root init container"
        (c,) = spec["containers"]
        cmd = c["command"]
        assert cmd[cmd.index("--deliver") + 1] == DELIVERY.url
        assert cmd[cmd.index("--upload-credential-file") + 1] == f"{jobs.CREDENTIAL_MOUNT}/{jobs.CREDENTIAL_KEY}"
        upload = next(v for v in spec["volumes"] if v["name"] == "upload")
        pod_ann = job["spec"]["template"]["metadata"]["annotations"]
        if cfg.kek_file:
            assert upload["secret"]["secretName"] == "j" and jobs.ANNOTATION_CREDENTIAL not in pod_ann
        else:
            assert pod_ann[jobs.ANNOTATION_CREDENTIAL] == "isu1.x.y" and "downwardAPI" in upload
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] and sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_an_encode_job_delivering_over_tls_checks_the_pod_against_the_fleet_ca() -> None:
    """With the fleet's TLS on, the delivery URL is https and the Job gets the CA certificate (public, its pod's
    annotation as a file) and the server name, so it verifies the pod as the operator does."""
    import dataclasses

    to = dataclasses.replace(DELIVERY, url=DELIVERY.url.replace("http://", "https://"), ca_pem="-----BEGIN CERT",
                             server_name="fleet.ns.svc")
    for cfg in (Settings(kek_secret="kek"), Settings(kek_file="/k")):
        job = jobs.job_manifest("j", "t", "cr", "uid-1", "u", "m", ["a"], cfg, to, "isu1.x.y")
        spec = job["spec"]["template"]["spec"]
        cmd = spec["containers"][0]["command"]
        assert cmd[cmd.index("--tls-ca-file") + 1] == f"{jobs.FLEET_CA_MOUNT}/{jobs.FLEET_CA_KEY}"
        assert cmd[cmd.index("--tls-server-name") + 1] == "fleet.ns.svc"
        assert job["spec"]["template"]["metadata"]["annotations"][jobs.ANNOTATION_FLEET_CA] == "-----BEGIN CERT"
        ca = next(v for v in spec["volumes"] if v["name"] == "fleet-ca")
        assert "downwardAPI" in ca
    plain = jobs.job_manifest("j", "t", "cr", "uid-1", "u", "m", ["a"], Settings(kek_file="/k"), DELIVERY, "c")
    assert "--tls-ca-file" not in plain["spec"]["template"]["spec"]["containers"][0]["command"]


def test_a_delivery_with_tls_refuses_a_plain_http_url(tmp_path) -> None:
    from inferscale.delivery import deliver
    from inferscale.fleettls import FleetTls

    tls = FleetTls(tmp_path / "ca.crt", "fleet.ns.svc")
    with pytest.raises(ConfigError, match="must be https"):
        deliver("http://10.0.0.1:8001/internal/v1/ingest/t/u", str(tmp_path / "cred"), tmp_path, ["a"], tls)


def test_an_items_hash_covers_the_items_encoded_before_it():
    """Editing, inserting or removing an item changes the hashes of the items behind it (they are encoded behind
    it, so they must be encoded again) and of no item before it."""
    from inferscale.operator.spec import CONTEXT_ITEMS, Desired, Item

    def hashes(texts):
        items = {f"i{n}": Item(f"i{n}", t) for n, t in texts}
        return Desired("u", "gemma-3-270m", items, 1, {}).item_hashes()

    n = CONTEXT_ITEMS + 3
    base = hashes([(k, f"fact {k}") for k in range(n)])
    edited = hashes([(k, "changed" if k == 1 else f"fact {k}") for k in range(n)])
    assert [i for i in base if base[i] != edited[i]] == [f"i{k}" for k in range(1, 2 + CONTEXT_ITEMS)]
    removed = hashes([(k, f"fact {k}") for k in range(n) if k != 1])
    assert [i for i in removed if removed[i] != base[i]] == [f"i{k}" for k in range(2, 2 + CONTEXT_ITEMS)]


def test_operator_and_engine_agree_on_the_context():
    from inferscale.engine.encoder import DEFAULT_CONTEXT_ITEMS
    from inferscale.operator.spec import CONTEXT_ITEMS

    assert CONTEXT_ITEMS == DEFAULT_CONTEXT_ITEMS


def test_main_watches_only_the_tenant_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    import kopf

    runs: list[dict[str, object]] = []
    monkeypatch.setattr(kopf, "run", lambda **kw: runs.append(kw))
    monkeypatch.setenv("INFERSCALE_TENANTS", "acme,globex")
    assert main([]) == 0
    monkeypatch.setenv("INFERSCALE_TENANTS", "")
    monkeypatch.setenv("INFERSCALE_JOB_NAMESPACE", "platform")
    assert main([]) == 0
    assert [(r["clusterwide"], r["namespaces"]) for r in runs] == [(False, ["acme", "globex"]), (False, ["platform"])]


def test_objects_the_operator_creates_carry_the_standard_labels() -> None:
    job = encode_job(Settings())
    for meta in (job["metadata"], job["spec"]["template"]["metadata"]):
        lab = meta["labels"]
        assert lab["app.kubernetes.io/name"] == "inferscale" and lab["app.kubernetes.io/component"] == "encode"
        assert lab["app.kubernetes.io/managed-by"] == "inferscale-operator"
        # never mistaken for a serving pod by the operator's own server selector
        assert lab["app.kubernetes.io/component"] != "server"


@pytest.mark.parametrize("name", ["a" * 62 + "-bcd", "a" * 62 + ".bcd", "x" * 253, "a.b" + "-" * 70 + "c", "short"])
def test_label_values_from_names_are_always_valid(name: str) -> None:
    from operator_fakes import LABEL_VALUE  # the API server's rule, written independently

    lab = jobs.labels("acme", name, "uid-1", "encode")
    value = lab["inferscale.io/usermemory"]
    assert len(value) <= 63 and LABEL_VALUE.match(value), value
    assert value == jobs.labels("acme", name, "uid-2", "items")["inferscale.io/usermemory"], "stable per name"
    if len(name) <= 63:
        assert value == name, "a name that is a valid value is kept as it is"


def test_distinct_long_names_keep_distinct_label_values() -> None:
    a, b = "a" * 62 + "-x", "a" * 62 + "-y"
    assert jobs.labels("t", a, "u", "encode")["inferscale.io/usermemory"] != \
        jobs.labels("t", b, "u", "encode")["inferscale.io/usermemory"]
