"""The chart's `helm test` hook and its install notes: the hook pod calls /healthz of the tenant Service (its script
is run here against a real local server), and NOTES.txt names no repository path or missing README section; its
inline UserMemory is valid against the CRD."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import jsonschema
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helm_tools  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "inferscale"
K8S_VERSION = "1.37.0"
HOOK_SUFFIX = "-test-healthz"


@lru_cache(maxsize=1)
def _tools() -> Path:
    try:
        return helm_tools.ensure_tools()
    except helm_tools.ToolsUnavailable as exc:  # a clear failure, never a silent skip
        pytest.fail(f"cannot run the chart checks: {exc}", pytrace=False)


def _helm(*args: str) -> str:
    home = _tools() / "helm-home"
    env = dict(os.environ, HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
               HELM_DATA_HOME=str(home / "data"))
    env.pop("KUBECONFIG", None)
    proc = subprocess.run([str(_tools() / "helm"), *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stderr}{proc.stdout}"
    return proc.stdout


@lru_cache(maxsize=8)
def _render(*sets: str) -> tuple[dict, ...]:
    args = ["template", "rel", str(CHART), "--namespace", "ns"] + [a for s in sets for a in ("--set", s)]
    return tuple(d for d in yaml.safe_load_all(_helm(*args)) if d)


def _notes(*sets: str) -> str:
    args = ["install", "rel", str(CHART), "--namespace", "ns", "--dry-run=client"]
    out = _helm(*args, *[a for s in sets for a in ("--set-string", s)])
    return out.split("\nNOTES:\n", 1)[1]


def _hook_pod(manifests) -> dict:
    pods = [m for m in manifests if m["kind"] == "Pod" and m["metadata"]["name"].endswith(HOOK_SUFFIX)]
    assert len(pods) == 1
    return pods[0]


def _tenant_service(manifests) -> dict:
    services = [m for m in manifests if m["kind"] == "Service" and not m["spec"].get("clusterIP") == "None"
                and m["metadata"]["labels"].get("app.kubernetes.io/component") == "server"]
    assert len(services) == 1
    return services[0]


def test_helm_test_hook_targets_the_tenant_service():
    manifests = _render()
    pod = _hook_pod(manifests)
    annotations = pod["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "test"
    assert "hook-succeeded" in annotations["helm.sh/hook-delete-policy"]
    assert pod["spec"]["restartPolicy"] == "Never"
    svc = _tenant_service(manifests)
    url = pod["spec"]["containers"][0]["command"][-1]
    assert url == f"http://{svc['metadata']['name']}.ns.svc:{svc['spec']['ports'][0]['port']}/healthz"
    # The hook pod is no serving pod: neither the Service nor the operator's selector may pick it up.
    labels = pod["metadata"]["labels"]
    assert not all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())


def test_helm_test_hook_validates_strict():
    from kubernetes_validate import utils as kv

    kv.validate(_hook_pod(_render()), K8S_VERSION, strict=True)
    c = _hook_pod(_render())["spec"]["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_helm_test_hook_follows_the_service_port():
    pod = _hook_pod(_render("server.service.port=9000", "fullnameOverride=edge"))
    assert pod["spec"]["containers"][0]["command"][-1] == "http://edge.ns.svc:9000/healthz"


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - http.server's name
        body = b'{"status": "ok"}' if self.path == "/healthz" else b"{}"
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


def _run_hook_script(url: str, attempts: int = 10) -> subprocess.CompletedProcess:
    command = _hook_pod(_render())["spec"]["containers"][0]["command"]
    assert command[:2] == ["python", "-c"] and "range(10)" in command[2]
    script = command[2].replace("range(10)", f"range({attempts})")
    return subprocess.run([sys.executable, "-c", script, url], capture_output=True, text=True, timeout=60)


def _serve():
    server = HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_helm_test_hook_script_passes_on_a_healthy_server():
    server = _serve()
    try:
        proc = _run_hook_script(f"http://127.0.0.1:{server.server_port}/healthz")
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "200" in proc.stdout


def test_helm_test_hook_script_fails_unless_200():
    server = _serve()
    try:
        proc = _run_hook_script(f"http://127.0.0.1:{server.server_port}/nothing", attempts=1)
    finally:
        server.shutdown()
    assert proc.returncode == 1 and "404" in proc.stdout


def test_notes_name_no_repository_path_or_missing_section():
    notes = _notes()
    assert not re.search(r"\b(crds|charts|docs|examples)/", notes), notes
    assert "README" not in notes
    assert "helm test rel -n ns" in notes
    assert "apiKeys.tenants.acme[0]=$HASH" in notes  # no keys configured: how to add one, inline
    assert "apiKeys.tenants.acme" not in _notes("apiKeys.tenants.acme[0]=" + "ab" * 32)


def test_notes_usermemory_is_valid_against_the_crd():
    notes = _notes()
    start = notes.index("echo '") + len("echo '")
    manifest = json.loads(notes[start:notes.index("' | kubectl apply -f -", start)])
    crd = yaml.safe_load((CHART / "crds" / "usermemory.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == manifest["apiVersion"].split("/")[1])
    assert manifest["kind"] == crd["spec"]["names"]["kind"]
    jsonschema.validate(manifest, version["schema"]["openAPIV3Schema"])
    assert manifest["spec"]["memories"] and manifest["metadata"]["namespace"] == "acme"
