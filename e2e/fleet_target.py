"""The local target with two nodes (issue 13): two real server processes, each playing the serving pod of one node.

What differs from LocalTarget (local_target.py), and why:
- node 1 (`e2e-node-0`) runs the encode Jobs (one node agent stand-in) and its server mounts the Job hostPath;
  node 2 (`e2e-node-1`) has its own hostPath dir (`workdir/node2/kv`): on one machine, a different directory
  plays another node's disk, so node 2 cannot read node 1's Job output and must pull over the peer plane;
- each server binds its own loopback address (127.0.0.2, 127.0.0.3: the pods' IPs) with the SAME NIXL port, so
  the operator derives both peer addresses as `podIP:INFERSCALE_NIXL_PORT`, as in a cluster; the peer plane is
  real (HMAC with a shared INFERSCALE_PEER_SECRET over TLS, real NIXL agents, UCX on loopback);
- node 2's server has a smaller DRAM budget, so the operator's placement (most free capacity) picks node 1:
  node 2 holds nothing until a request reaches it.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from inferscale.kvformat import SUFFIX

from e2e_common import free_port, free_ports, tail, wait_for
from local_target import NODE, SELECTOR, SERVER_NS, SERVER_POD, LocalTarget

NODE_2 = "e2e-node-1"
SERVER_POD_2 = "inferscale-server-1"
IPS = {NODE: "127.0.0.2", NODE_2: "127.0.0.3"}


class FleetTarget(LocalTarget):
    name = "local-fleet"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.peer_secret = "peer-" + secrets.token_hex(16)
        self.nixl_port = free_port()
        self.servers: dict[str, dict[str, Any]] = {}

    def start(self) -> FleetTarget:
        self._start_api()
        tenants = self.workdir / "tenants.json"
        from inferscale.server.auth import hash_key

        tenants.write_text(json.dumps({self.tenant: [hash_key(self.api_key)],
                                       self.tenant_b: [hash_key(self.api_key_b)]}))
        self._start_node_server(NODE, SERVER_POD, 256 << 20, tenants)
        self._start_node_server(NODE_2, SERVER_POD_2, 128 << 20, tenants)
        for s in self.servers.values():
            self._wait_ready(s)
        self.server, self.server_url, self.internal_url = (self.servers[NODE]["proc"], self.servers[NODE]["url"],
                                                           self.servers[NODE]["internal"])
        self.server_out, self.server_log = self.servers[NODE]["out"], self.servers[NODE]["err"]
        for node, s in self.servers.items():
            self._register(node, s)
        self._start_agent_and_operator()
        return self

    def _env(self, **extra: str) -> dict[str, str]:
        env = super()._env(**extra)
        # The operator derives peers from podIP + this port; its recheck tick republishes them.
        env.setdefault("INFERSCALE_NIXL_PORT", str(self.nixl_port))
        if "KUBECONFIG" in extra:
            env["INFERSCALE_RECHECK_SECONDS"] = "2"
        return env

    def _start_node_server(self, node: str, pod: str, dram: int, tenants: Path) -> None:
        host = IPS[node]
        data = self.workdir / f"data-{node}"
        data.mkdir(parents=True)
        port, internal_port = free_ports(2)
        out, err = self.workdir / f"server-{node}.out", self.workdir / f"server-{node}.err"
        env = self._env(INFERSCALE_DATA_DIR=str(data), INFERSCALE_TENANTS_FILE=str(tenants),
                        INFERSCALE_MODEL=self.model, INFERSCALE_HOST=host, INFERSCALE_PORT=str(port),
                        INFERSCALE_DEVICE="cpu", INFERSCALE_INTERNAL_TOKEN=self.internal_token,
                        INFERSCALE_PEER_SECRET=self.peer_secret, INFERSCALE_NODE_NAME=node,
                        INFERSCALE_POD_NAME=pod,
                        INFERSCALE_INTERNAL_PORT=str(internal_port), INFERSCALE_KEK_FILE=str(self.kek_file),
                        INFERSCALE_CONSOLE_TRACES="true", INFERSCALE_DRAM_BUDGET_BYTES=str(dram),
                        **self.server_tls_env())
        with open(out, "wb") as o, open(err, "wb") as e:
            proc = subprocess.Popen([sys.executable, "-m", "inferscale.cli", "serve"], cwd=self.image_dir, env=env,
                                    stdout=o, stderr=e, stdin=subprocess.DEVNULL)
        self.servers[node] = {"proc": proc, "url": f"http://{host}:{port}", "internal": f"https://{host}:{internal_port}",
                              "out": out, "err": err, "data": data, "pod": pod}

    def _wait_ready(self, s: dict[str, Any]) -> None:
        def ready() -> bool:
            if s["proc"].poll() is not None:
                raise AssertionError(f"server exited with {s['proc'].returncode}\n{tail(s['err'], 40)}")
            try:
                return httpx.get(s["url"] + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 180, f"{s['pod']} /readyz", self.diag)

    def _register(self, node: str, s: dict[str, Any]) -> None:
        self._ok(self.http.post("/api/v1/nodes", json={"metadata": {"name": node, "labels": {
            "kubernetes.io/hostname": node}}}))
        self._ok(self.http.post(f"/api/v1/namespaces/{SERVER_NS}/pods", json={
            "metadata": {"name": s["pod"], "namespace": SERVER_NS, "labels": SELECTOR,
                         "annotations": {"inferscale.io/endpoint": s["internal"]}},
            "spec": {"nodeName": node, "containers": [{"name": "server", "image": "inferscale"}]},
            "status": {"phase": "Running", "podIP": IPS[node], "conditions": [{"type": "Ready", "status": "True"}]}}))

    def close(self) -> None:
        from e2e_common import stop_process

        for s in self.servers.values():
            stop_process(s["proc"])
        self.server = None
        super().close()

    # -- what the test uses -----------------------------------------------------------------------------------
    def node_url(self, node: str) -> str:
        return self.servers[node]["url"]

    def node_internal(self, node: str) -> str:
        return self.servers[node]["internal"]

    def node_spans(self, node: str) -> list[dict[str, Any]]:
        from e2e_common import parse_console_spans

        return parse_console_spans(self.servers[node]["out"].read_text(errors="replace"))

    def node_blobs(self, node: str, user: str) -> list[str]:
        """Every blob of the user anywhere under that node's server data dir (Jobs deliver there; no node dir)."""
        root = self.servers[node]["data"]
        return sorted(str(p) for p in Path(root).rglob(f"*{SUFFIX}") if self.tenant in p.parts and user in p.parts)

    def diag(self) -> str:
        parts = [super().diag()]
        for node, s in self.servers.items():
            parts.append(f"--- server {node}\n{tail(s['err'], 30)}")
        return "\n".join(parts)
