"""The real-control-plane target (issue 19): the e2e scenarios on etcd + kube-apiserver + kube-controller-manager +
kube-scheduler (controlplane.py), with charts/inferscale installed by `helm install` (CRD included, RBAC in force).

- nodes: one or two kubelet stand-ins (kubelet_standin.py, the one fake in the loop), e2e-node-0 (127.0.0.2) and
  e2e-node-1 (127.0.0.3); the server is a DaemonSet, so one serving pod per node, and the encode Jobs are steered
  to e2e-node-0 by a node label (encoder.nodeSelector);
- disks: none shared. No pod mounts a node directory (Pod Security `restricted` on the release and Jobs'
  namespaces, which the chart labels): an encode Job delivers its blobs to the serving pod the operator chose, and
  the other node's pod pulls them over the peer plane;
- the operator is the chart's Deployment, run by a stand-in under its own ServiceAccount's token;
- tenants act with identities of their own (platform_install.py): tenant-a a user, tenant-b a ServiceAccount,
  each bound only in its namespace; every `kubectl` of the test runs as the tenant of the namespace it names;
- the model is the tiny random-weight gemma3 (`tiny-e2e`) in the directory that plays the image;
- Jobs: in a namespace of their own, the chart's default `<release namespace>-jobs` (or `jobs_namespace`, given as
  encoder.namespace): no platform Secret there; the operator holds the KEK and gives each Job a Secret of its
  tenant's derived keys, and in the release namespace it may only read pods.
Ports (chart values) are in the 181xx range, away from the defaults other test runs on this machine may use.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import yaml

from inferscale.kvformat import SUFFIX

from controlplane import start_for_tests
from e2e_common import chart_tls, parse_console_spans, tail
from platform_install import JOBS_NAMESPACE, NAMESPACE, TENANTS, Platform

NODES = {"e2e-node-0": "127.0.0.2", "e2e-node-1": "127.0.0.3"}  # the names FleetTarget uses
ENCODER_LABEL = {"inferscale.io/e2e-encoder": "true"}
PORT, INTERNAL_PORT, NIXL_PORT, UCX_RANGE, HEALTH_PORT = 18150, 18151, 18152, "18153-18170", 18171


class RealTarget:
    name = "real"
    model = "tiny-e2e"
    apply_flags: list[str] = []
    ready_timeout, gone_timeout = 300.0, 180.0
    tenant, tenant_b = TENANTS

    def __init__(self, workdir: Path, nodes: int = 1, jobs_namespace: str | None = None) -> None:
        self.workdir = Path(workdir)
        self.jobs_namespace = jobs_namespace or JOBS_NAMESPACE
        self.image_dir = self.workdir / "image"
        self.node_names = list(NODES)[:nodes]
        self.api_key = "isk-e2e-" + secrets.token_urlsafe(16)
        self.api_key_b = "isk-e2e-" + secrets.token_urlsafe(16)
        self.nixl_port = NIXL_PORT
        self.cp: Any = None
        self.kubelets: dict[str, Any] = {}
        self.tls: Any = None  # the chart's TLS, as clients of the internal API verify it (after start)

    def start(self) -> RealTarget:
        import tiny_models
        from inferscale.server.auth import hash_key

        from kubelet_standin import KubeletStandIn

        d = self.image_dir / self.model
        tiny_models.model("gemma3").save_pretrained(d)
        tiny_models.tokenizer().save_pretrained(d)
        self.cp = start_for_tests(self.workdir / "control-plane")
        for i, node in enumerate(self.node_names):
            self.kubelets[node] = KubeletStandIn(
                self.cp, node, ip=NODES[node], image_dir=self.image_dir, work_dir=self.workdir / node,
                host_root=self.workdir / f"{node}-disk", gpus=0, labels=ENCODER_LABEL if i == 0 else {}).start()
        self.platform = Platform(self.cp)
        jobs_args = [] if self.jobs_namespace == JOBS_NAMESPACE else ["--set", f"encoder.namespace={self.jobs_namespace}"]
        extra_env = [{"name": "OTEL_SDK_DISABLED", "value": "false"},
                     {"name": "INFERSCALE_CONSOLE_TRACES", "value": "true"}]
        self.platform.install(
            "--set", f"model.name={self.model}", "--set", "server.kind=DaemonSet",
            "--set", f"server.port={PORT}", "--set", f"server.internalPort={INTERNAL_PORT}",
            "--set", f"server.nixlPort={NIXL_PORT}", "--set", f"server.ucxPortRange={UCX_RANGE}",
            "--set", f"operator.healthPort={HEALTH_PORT}", "--set", "server.dramBudgetBytes=268435456",
            "--set", "operator.jobPollSeconds=1", "--set", "operator.recheckSeconds=2", "--set", "operator.verbose=true",
            "--set-json", "encoder.nodeSelector=" + json.dumps(ENCODER_LABEL),
            "--set-json", "server.extraEnv=" + json.dumps(extra_env),
            "--set-json", "apiKeys.tenants=" + json.dumps({self.tenant: [hash_key(self.api_key)],
                                                           self.tenant_b: [hash_key(self.api_key_b)]}),
            *jobs_args, "--wait", "--timeout", "8m")
        self.internal_token = self.platform.internal_token
        self.http = self.cp.client()
        self.tls = self._chart_tls()
        return self

    def _chart_tls(self):
        """The chart's TLS (tls.enabled, its default) as the operator sees it: the CA of Secret <release>-tls and
        the servers' INFERSCALE_TLS_SERVER_NAME; None when the chart was installed without it."""
        config = self._get(f"/api/v1/namespaces/{NAMESPACE}/configmaps/inferscale-server") or {}
        name = (config.get("data") or {}).get("INFERSCALE_TLS_SERVER_NAME")
        if not name:
            return None
        secret = self._get(f"/api/v1/namespaces/{NAMESPACE}/secrets/inferscale-tls")
        assert secret is not None, "tls.enabled but no Secret inferscale-tls"
        return chart_tls(secret["data"], name, self.workdir / "tls")

    def close(self) -> None:
        for kubelet in self.kubelets.values():
            kubelet.stop()
        if self.cp is not None:
            self.cp.stop()

    # -- the tenants' kubectl, the test's observations (as admin) ---------------------------------------------
    def kubectl(self, *args: str) -> Any:
        """kubectl as the tenant whose namespace the command names (`-n`, or the manifest's namespace)."""
        namespace = args[args.index("-n") + 1] if "-n" in args else None
        if namespace is None and "-f" in args:
            namespace = yaml.safe_load(Path(args[args.index("-f") + 1]).read_text())["metadata"]["namespace"]
        return self.platform.kubectl(*args, kubeconfig=self.platform.tenant_kubeconfigs[namespace])

    def _get(self, path: str) -> dict[str, Any] | None:
        resp = self.http.get(path)
        if resp.status_code == 404:
            return None
        assert resp.status_code == 200, f"GET {path}: {resp.status_code} {resp.text}"
        return resp.json()

    def get_um(self, name: str, tenant: str | None = None) -> dict[str, Any] | None:
        self._alive()
        return self._get(f"/apis/inferscale.io/v1alpha1/namespaces/{tenant or self.tenant}/usermemories/{name}")

    def events(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return list((self._get(f"/api/v1/namespaces/{tenant or self.tenant}/events") or {}).get("items") or [])

    def jobs(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """The Jobs of `namespace`, by default where the operator runs them."""
        namespace = namespace or self.jobs_namespace
        return list((self._get(f"/apis/batch/v1/namespaces/{namespace}/jobs") or {}).get("items") or [])

    def job_host_paths(self, job: dict[str, Any]) -> list[str]:
        """The node paths the Job's pod mounts (hostPath volumes, init containers included): none is admitted."""
        spec = job["spec"]["template"]["spec"]
        host = {v["name"]: v["hostPath"]["path"] for v in spec.get("volumes") or [] if "hostPath" in v}
        return sorted({host[m["name"]] for c in [*spec.get("initContainers", []), *spec["containers"]]
                       for m in c.get("volumeMounts") or [] if m["name"] in host})

    # -- serving pods: reached on their pod IP (no kubelet API here: no port-forward, exec or logs) ----------
    def _server_pod(self, node: str | None = None, placement: dict[str, Any] | None = None) -> dict[str, Any]:
        if placement is not None:
            pod = self._get(f"/api/v1/namespaces/{placement['namespace']}/pods/{placement['pod']}")
            assert pod is not None, placement
            return pod
        pods = (self._get(f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=app.kubernetes.io/component%3Dserver"
                          f"&fieldSelector=spec.nodeName%3D{node}") or {}).get("items") or []
        running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
        assert running, f"no running serving pod on {node}"
        return running[0]

    def _url(self, pod: dict[str, Any], port: int) -> str:
        scheme = "https" if port == INTERNAL_PORT and self.tls is not None else "http"
        return f"{scheme}://{pod['status']['podIP']}:{port}"

    def _log(self, pod: dict[str, Any]) -> str:
        info = self.kubelets[pod["spec"]["nodeName"]].pods[pod["metadata"]["uid"]]
        return info["logs"]["server"].read_text(errors="replace")

    def _data_dir(self, pod: dict[str, Any]) -> Path:
        return self.workdir / pod["spec"]["nodeName"] / "pods" / pod["metadata"]["uid"] / "volumes" / "data"

    def endpoint(self, placement: dict[str, Any]) -> str:
        return self._url(self._server_pod(placement=placement), PORT)

    def internal_endpoint(self, placement: dict[str, Any]) -> str:
        return self._url(self._server_pod(placement=placement), INTERNAL_PORT)

    def spans(self, placement: dict[str, Any]) -> list[dict[str, Any]]:
        return parse_console_spans(self._log(self._server_pod(placement=placement)))

    def store_blobs(self, placement: dict[str, Any], user: str) -> list[str]:
        root = self._data_dir(self._server_pod(placement=placement)) / "store"
        return sorted(str(p.relative_to(root)) for p in root.rglob(f"*{SUFFIX}")
                      if p.relative_to(root).parts[:2] == (self.tenant, user))

    # -- the fleet scenario -------------------------------------------------------------------------------------
    def node_url(self, node: str) -> str:
        return self._url(self._server_pod(node), PORT)

    def node_internal(self, node: str) -> str:
        return self._url(self._server_pod(node), INTERNAL_PORT)

    def node_spans(self, node: str) -> list[dict[str, Any]]:
        return parse_console_spans(self._log(self._server_pod(node)))

    def node_blobs(self, node: str, user: str) -> list[str]:
        """Every blob of the user in that node's serving pod's data dir (no pod writes the node's disk)."""
        root = self._data_dir(self._server_pod(node))
        return sorted(str(p) for p in root.rglob(f"*{SUFFIX}") if self.tenant in p.parts and user in p.parts)

    # -- diagnostics --------------------------------------------------------------------------------------------
    def _alive(self) -> None:
        for name, proc in self.cp.procs.items():
            assert proc.poll() is None, f"{name} exited with {proc.returncode}\n{self.diag()}"

    def diag(self) -> str:
        parts = [self.cp.diag() if self.cp is not None else ""]
        for kubelet in self.kubelets.values():
            parts.append(f"--- stand-in {kubelet.node}: errors={kubelet.errors[-5:]}")
            for info in kubelet.pods.values():
                parts += [tail(log, 30) for log in info["logs"].values()]
        return "\n".join(parts)
