"""The local target: everything on loopback, in CI.

- API server: the KMock emulator (tests/operator/operator_fakes.py: kmock 0.8 plus the workarounds a real API
  server would not need), reached over HTTP by kubectl, the operator and the node agent alike;
- operator: the real one, as a subprocess (`python -m inferscale.operator`, KUBECONFIG -> the emulator);
- serving pod: the real server as a subprocess (`python -m inferscale.cli serve`), registered in the emulator as
  a Pod object (labels, `inferscale.io/endpoint` annotation, nodeName, Running/Ready) -- nothing starts it for you;
- TLS as the chart sets it (tls.enabled): a CA and the fleet certificate (e2e/pki.py), the internal API served
  over HTTPS, the operator verifying it against the CA for the fleet's name, the peer channel over TLS both ways;
- kubelet: NodeAgentStandIn (node_agent.py) runs the encode Jobs the operator creates (in the platform namespace,
  SERVER_NS); they mount no host path and deliver their blobs to the server's internal listener;
- tenants: two namespaces, "acme" and "globex", each with its own API key;
- model: a tiny random-weight gemma3 saved as the directory `tiny-e2e` inside a dir that plays the image, which
  is the working dir of both the server and the encode Jobs, so `--model tiny-e2e` is the same model (same
  fingerprint) in both.
"""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from inferscale.kvformat import SUFFIX

from e2e_common import ROOT, free_ports, internal_get, stop_process, tail, tool, wait_for, parse_console_spans
from pki import fleet_tls_files

NODE = "e2e-node-0"
SERVER_NS = "inferscale-system"
KEK_SECRET = "inferscale-kek"  # the chart's <fullname>-kek
SERVER_POD = "inferscale-server-0"
SELECTOR = {"app.kubernetes.io/name": "inferscale", "app.kubernetes.io/component": "server"}
TLS_SERVER_NAME = f"inferscale-headless.{SERVER_NS}.svc"  # the chart's <fullname>-headless.<namespace>.svc


class LocalTarget:
    name = "local"
    tenant = "acme"
    tenant_b = "globex"
    model = "tiny-e2e"
    apply_flags = ["--validate=false"]  # the emulator serves no OpenAPI document to validate against
    ready_timeout, gone_timeout = 120.0, 60.0

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.image_dir = self.workdir / "image"
        self.data_dir = self.workdir / "server-data"
        self.api_key = "isk-e2e-" + secrets.token_urlsafe(16)
        self.api_key_b = "isk-e2e-" + secrets.token_urlsafe(16)
        self.internal_token = "e2e-" + secrets.token_hex(16)
        self.emu: Any = None
        self.server: subprocess.Popen | None = None
        self.operator: subprocess.Popen | None = None
        self.agent: Any = None
        self.server_url = ""
        self.internal_url = ""  # the server's internal listener when it has one, else its only port
        self.tls_files = fleet_tls_files(self.workdir / "tls", TLS_SERVER_NAME)

    @property
    def tls(self):
        """What a client of the internal API verifies (the fleet CA and name), as the operator does."""
        from inferscale.fleettls import FleetTls

        return FleetTls(self.tls_files["ca"], TLS_SERVER_NAME)

    def server_tls_env(self) -> dict[str, str]:
        return {"INFERSCALE_TLS_CERT_FILE": str(self.tls_files["cert"]),
                "INFERSCALE_TLS_KEY_FILE": str(self.tls_files["key"]),
                "INFERSCALE_TLS_CA_FILE": str(self.tls_files["ca"]), "INFERSCALE_TLS_SERVER_NAME": TLS_SERVER_NAME}

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> LocalTarget:
        self._start_api()
        self._start_server()
        self._register_serving_pod()
        self._start_agent_and_operator()
        return self

    def _start_api(self) -> None:
        """The image dir's model, the emulator with a kubeconfig for it, kubectl and the key-encryption key."""
        from operator_fakes import EmulatorThread

        self._save_model()
        self.emu = EmulatorThread().start()
        self.kubeconfig = self.workdir / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.emu.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}]}))
        self.kubectl_bin = tool("kubectl")
        self.http = httpx.Client(base_url=self.emu.url, timeout=10)
        self._write_kek()

    def _start_agent_and_operator(self) -> None:
        """The kubelet's stand-in on NODE, then the operator: once the serving pods are registered."""
        from node_agent import NodeAgentStandIn

        self.agent = NodeAgentStandIn(self.emu.url, NODE, self.image_dir, self.workdir / "pods").start()
        self._start_operator()

    def close(self) -> None:
        stop_process(self.operator)
        stop_process(self.server)
        if self.agent is not None:
            self.agent.stop()
        if self.emu is not None:
            self.http.close()
            self.emu.stop()

    def _save_model(self) -> None:
        import tiny_models

        d = self.image_dir / self.model
        tiny_models.model("gemma3").save_pretrained(d)
        tiny_models.tokenizer().save_pretrained(d)

    def _env(self, **extra: str) -> dict[str, str]:
        import os

        env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSCALE_", "OTEL_", "KUBERNETES_"))}
        env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", **extra)
        return env

    def _start_server(self) -> None:
        from inferscale.server.auth import hash_key

        self.data_dir.mkdir(parents=True)
        tenants = self.data_dir / "tenants.json"
        tenants.write_text(json.dumps({self.tenant: [hash_key(self.api_key)],  # tenant = namespace
                                       self.tenant_b: [hash_key(self.api_key_b)]}))
        port, internal_port, nixl_port = free_ports(3)
        self.server_url = f"http://127.0.0.1:{port}"
        self.server_log, self.server_out = self.workdir / "server.err", self.workdir / "server.out"
        env = self._env(INFERSCALE_DATA_DIR=str(self.data_dir), INFERSCALE_TENANTS_FILE=str(tenants),
                        INFERSCALE_MODEL=self.model, INFERSCALE_HOST="127.0.0.1", INFERSCALE_PORT=str(port),
                        INFERSCALE_DEVICE="cpu", INFERSCALE_INTERNAL_TOKEN=self.internal_token,
                        INFERSCALE_NODE_NAME=NODE, INFERSCALE_POD_NAME=SERVER_POD,
                        INFERSCALE_INTERNAL_PORT=str(internal_port), INFERSCALE_KEK_FILE=str(self.kek_file),
                        INFERSCALE_NIXL_PORT=str(nixl_port), INFERSCALE_CONSOLE_TRACES="true",
                        INFERSCALE_DRAM_BUDGET_BYTES=str(256 << 20), **self.server_tls_env())
        with open(self.server_out, "wb") as out, open(self.server_log, "wb") as err:
            self.server = subprocess.Popen([sys.executable, "-m", "inferscale.cli", "serve"], cwd=self.image_dir,
                                           env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)

        def ready() -> bool:
            if self.server.poll() is not None:
                raise AssertionError(f"server exited with {self.server.returncode}\n{self.diag()}")
            try:
                return httpx.get(self.server_url + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 90, "the server's /readyz", self.diag)
        self.internal_url = self._internal_listener(internal_port)

    def _internal_listener(self, port: int) -> str:
        """The internal API's base URL: the separate listener on `port` when this server opens one, else the tenant
        port (a server from before the split serves /internal/v1/* there)."""
        url = f"https://127.0.0.1:{port}"
        try:
            internal_get(self, url + "/internal/v1/capacity", timeout=2)
            return url
        except httpx.HTTPError:
            return self.server_url

    def _write_kek(self) -> None:
        """The chart's KEK Secret: the server reads it as INFERSCALE_KEK_FILE, encode Jobs get it mounted."""
        from inferscale.sealing import ensure_kek_file

        self.kek_file = self.workdir / "kek"
        ensure_kek_file(self.kek_file)
        self._ok(self.http.post(f"/api/v1/namespaces/{SERVER_NS}/secrets", json={
            "metadata": {"name": KEK_SECRET, "namespace": SERVER_NS},
            "data": {"kek": base64.b64encode(self.kek_file.read_bytes()).decode()}}))

    def _register_serving_pod(self) -> None:
        self._ok(self.http.post("/api/v1/nodes", json={"metadata": {"name": NODE, "labels": {
            "kubernetes.io/hostname": NODE}}}))
        self._ok(self.http.post(f"/api/v1/namespaces/{SERVER_NS}/pods", json={
            "metadata": {"name": SERVER_POD, "namespace": SERVER_NS, "labels": SELECTOR,
                         "annotations": {"inferscale.io/endpoint": self.internal_url}},
            "spec": {"nodeName": NODE, "containers": [{"name": "server", "image": "inferscale"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}))

    def _start_operator(self) -> None:
        self.operator_log = self.workdir / "operator.log"
        env = self._env(KUBECONFIG=str(self.kubeconfig), INFERSCALE_SERVER_NAMESPACE=SERVER_NS,
                        INFERSCALE_SERVER_SELECTOR=",".join(f"{k}={v}" for k, v in SELECTOR.items()),
                        INFERSCALE_INTERNAL_TOKEN=self.internal_token, INFERSCALE_ENCODER_IMAGE="inferscale:e2e",
                        INFERSCALE_ENCODER_GPUS="0",
                        INFERSCALE_MODELS=self.model, INFERSCALE_JOB_POLL_SECONDS="0.5",
                        INFERSCALE_TENANTS=f"{self.tenant},{self.tenant_b}", INFERSCALE_JOB_NAMESPACE=SERVER_NS,
                        INFERSCALE_KEK_SECRET=KEK_SECRET, INFERSCALE_TLS_CA_FILE=str(self.tls_files["ca"]),
                        INFERSCALE_TLS_SERVER_NAME=TLS_SERVER_NAME,
                        INFERSCALE_RECHECK_SECONDS="30", INFERSCALE_HTTP_TIMEOUT_SECONDS="30")
        with open(self.operator_log, "wb") as out:
            self.operator = subprocess.Popen([sys.executable, "-m", "inferscale.operator", "--verbose"], cwd=ROOT,
                                             env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    # -- what the test uses -----------------------------------------------------------------------------------
    def kubectl(self, *args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.kubectl_bin, "--kubeconfig", str(self.kubeconfig), *args], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, f"kubectl {' '.join(args)}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def get_um(self, name: str, tenant: str | None = None) -> dict[str, Any] | None:
        self._alive()
        resp = self.http.get(f"/apis/inferscale.io/v1alpha1/namespaces/{tenant or self.tenant}/usermemories/{name}")
        return None if resp.status_code == 404 else self._ok(resp)

    def events(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return list(self._ok(self.http.get(f"/api/v1/namespaces/{tenant or self.tenant}/events")).get("items") or [])

    def jobs(self, namespace: str = SERVER_NS) -> list[dict[str, Any]]:
        """Jobs in a namespace; by default the platform namespace, where the operator runs them."""
        return list(self._ok(self.http.get(f"/apis/batch/v1/namespaces/{namespace}/jobs")).get("items") or [])

    def job_host_paths(self, job: dict[str, Any]) -> list[str]:
        """The node paths the stand-in kubelet mounted into the Job's pod (what it could see of the node's disk)."""
        (info,) = [i for i in self.agent.handled.values() if i["name"] == job["metadata"]["name"]]
        return list(info["host_paths"])

    def endpoint(self, placement: dict[str, Any]) -> str:
        assert (placement["namespace"], placement["pod"], placement["node"]) == (SERVER_NS, SERVER_POD, NODE)
        return self.server_url

    def internal_endpoint(self, placement: dict[str, Any]) -> str:
        assert (placement["namespace"], placement["pod"]) == (SERVER_NS, SERVER_POD)
        return self.internal_url

    def spans(self, placement: dict[str, Any]) -> list[dict[str, Any]]:
        return parse_console_spans(self.server_out.read_text(errors="replace"))

    def store_blobs(self, placement: dict[str, Any], user: str) -> list[str]:
        """Blob files of the user in the pod's disk tier (the store keeps <root>/<tenant>/<user>/...)."""
        root = self.data_dir / "store"
        return sorted(str(p.relative_to(root)) for p in root.rglob(f"*{SUFFIX}")
                      if p.relative_to(root).parts[:2] == (self.tenant, user))

    def diag(self) -> str:
        parts = [tail(self.operator_log, 60) if self.operator is not None else "",
                 tail(self.server_log, 30) if self.server is not None else ""]
        if self.agent is not None:
            parts.append(f"--- node agent: errors={self.agent.errors[-5:]}")
            for info in self.agent.handled.values():
                parts.append(f"job {info['name']} rc={info['rc']} argv={info['argv']}\n{tail(info['log'], 20)}")
        return "\n".join(p for p in parts if p)

    def _alive(self) -> None:
        for what, proc in (("operator", self.operator), ("server", self.server)):
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the {what} exited with {proc.returncode}\n{self.diag()}")

    @staticmethod
    def _ok(resp: httpx.Response) -> dict[str, Any]:
        assert resp.status_code < 300, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
        return resp.json()
