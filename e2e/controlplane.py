"""A real Kubernetes control plane on loopback, started by the e2e: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler, all from the one binary e2e/controlplane_build.py builds from their Go modules.

What is real: TLS everywhere but etcd (loopback only), x509 client certificates and service-account tokens as the
identities, `--authorization-mode=Node,RBAC`, admission with PodSecurity and NodeRestriction, the CRD structural-schema
and CEL checks, the controllers (Job, garbage collector, ReplicaSet/StatefulSet, service accounts, node lifecycle,
namespace deletion) and the scheduler. What is not there: a kubelet (nodes are played by e2e/kubelet_standin.py),
kube-proxy, a CNI, a DNS.

Ports come from INFERSCALE_CP_PORTS (a range "lo-hi", default 18100-18149: real_target.py gives the chart's pods
18150-18171), so two suites on one machine can be kept apart.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
from pathlib import Path
from typing import Any

import httpx

from controlplane_build import ControlPlaneUnavailable, built
from e2e_common import stop_process, tail, wait_for
from pki import CertificateAuthority, service_account_keys

SERVICE_CIDR = "10.96.0.0/24"
ISSUER = "https://kubernetes.default.svc.cluster.local"


def _ports(n: int) -> list[int]:
    lo, hi = (int(p) for p in os.environ.get("INFERSCALE_CP_PORTS", "18100-18149").split("-"))
    found = []
    for port in range(lo, hi + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise RuntimeError(f"fewer than {n} free ports in {lo}-{hi} (INFERSCALE_CP_PORTS)")


class ControlPlane:
    def __init__(self, workdir: Path, binary: Path | None = None) -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        found = binary or built()
        if found is None:
            raise ControlPlaneUnavailable("the control-plane binary is not built: run `bash scripts/test.sh` "
                                          "(or `python e2e/controlplane_build.py build`)")
        self.binary = Path(found)
        self.procs: dict[str, subprocess.Popen] = {}
        self.etcd_port, self.peer_port, self.port, self.cm_port, self.sched_port = _ports(5)
        self.url = f"https://127.0.0.1:{self.port}"

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> ControlPlane:
        pki = self.dir / "pki"
        self.ca = CertificateAuthority(pki)
        self.sa_key, self.sa_pub = service_account_keys(pki)
        serving = self.ca.issue("apiserver", cn="kube-apiserver", server_ips=("127.0.0.1", "10.96.0.1"),
                                server_names=("localhost", "kubernetes", "kubernetes.default",
                                              "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"))
        self.admin_kubeconfig = self.user_kubeconfig("admin", "kubernetes-admin", ("system:masters",))
        self._spawn("etcd", [
            "--name", "e2e", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster", f"e2e=http://127.0.0.1:{self.peer_port}",
            "--unsafe-no-fsync", "--log-level", "warn"])  # a throw-away store: durability buys nothing
        self._spawn("kube-apiserver", [
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}", "--bind-address=127.0.0.1",
            # No endpoints for the `kubernetes` Service: a loopback address may not be one (and nothing here
            # reaches the API server through a Service).
            "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none", f"--secure-port={self.port}",
            f"--tls-cert-file={serving[0]}", f"--tls-private-key-file={serving[1]}",
            f"--client-ca-file={self.ca.cert_file}",
            f"--service-account-key-file={self.sa_pub}", f"--service-account-signing-key-file={self.sa_key}",
            f"--service-account-issuer={ISSUER}", f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction,PodSecurity",
            # Privileged pods are allowed by the server, so that refusing one is Pod Security's doing.
            "--allow-privileged=true", "--profiling=false", "--v=1"])
        wait_for(self._api_ready, 120, "kube-apiserver /readyz", self.diag, interval=0.5)
        for name, port, cn in (("kube-controller-manager", self.cm_port, "system:kube-controller-manager"),
                               ("kube-scheduler", self.sched_port, "system:kube-scheduler")):
            kubeconfig = self.user_kubeconfig(name, cn)
            extra = ([f"--service-account-private-key-file={self.sa_key}", f"--root-ca-file={self.ca.cert_file}",
                      "--use-service-account-credentials=true", "--node-monitor-grace-period=60s"]
                     if name == "kube-controller-manager" else [])
            self._spawn(name, [f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                               f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1",
                               f"--secure-port={port}", "--leader-elect=false", "--v=1", *extra])
        for name, port in (("kube-controller-manager", self.cm_port), ("kube-scheduler", self.sched_port)):
            wait_for(lambda: self._healthy(name, port), 120, f"{name} /healthz", self.diag, interval=0.5)
        # The controller manager is healthy before its controllers run: the service-account controller's first
        # work (a `default` ServiceAccount) says they do; pods cannot be admitted without it.
        wait_for(lambda: self.has_default_service_account("default"), 120, "the controllers (default/default SA)",
                 self.diag, interval=0.5)
        return self

    def has_default_service_account(self, namespace: str) -> bool:
        with self.client() as c:
            return c.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default").status_code == 200

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            stop_process(self.procs[name])

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen([str(self.binary), name, *args], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)

    def _alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}\n{self.diag()}")

    def _api_ready(self) -> bool:
        self._alive("etcd")
        self._alive("kube-apiserver")
        try:
            with self.client() as c:
                return c.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def _healthy(self, name: str, port: int) -> bool:
        self._alive(name)
        try:
            return httpx.get(f"https://127.0.0.1:{port}/healthz", verify=False, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def diag(self) -> str:
        return "\n".join(tail(self.dir / f"{name}.log", 25) for name in self.procs)

    # -- identities -------------------------------------------------------------------------------------------
    def _write_kubeconfig(self, name: str, user: dict[str, str]) -> Path:
        path = self.dir / f"{name}.kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": name,
            "clusters": [{"name": "e2e", "cluster": {"server": self.url,
                                                     "certificate-authority": str(self.ca.cert_file)}}],
            "users": [{"name": name, "user": user}],
            "contexts": [{"name": name, "context": {"cluster": "e2e", "user": name}}]}))
        path.chmod(0o600)
        return path

    def user_kubeconfig(self, name: str, user: str, groups: tuple[str, ...] = ()) -> Path:
        """A kubeconfig for a user named by a client certificate (CN = user, O = groups)."""
        cert, key = self.ca.issue(name, cn=user, groups=groups)
        return self._write_kubeconfig(name, {"client-certificate": str(cert), "client-key": str(key)})

    def token_kubeconfig(self, namespace: str, service_account: str, seconds: int = 7200) -> Path:
        """A kubeconfig for a ServiceAccount, with a token from its TokenRequest (what a pod of it would get)."""
        return self._write_kubeconfig(f"sa-{namespace}-{service_account}",
                                      {"token": self.token(namespace, service_account, seconds)})

    def token(self, namespace: str, service_account: str, seconds: int = 7200) -> str:
        with self.client() as c:
            resp = c.post(f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
                          json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                "spec": {"expirationSeconds": seconds}})
        assert resp.status_code == 201, f"TokenRequest for {namespace}/{service_account}: {resp.text}"
        return resp.json()["status"]["token"]

    def client(self, kubeconfig: Path | None = None, **kwargs: Any) -> httpx.Client:
        """An HTTP client for the API server acting as the kubeconfig's identity (default: admin)."""
        user = json.loads(Path(kubeconfig or self.admin_kubeconfig).read_text())["users"][0]["user"]
        ctx = ssl.create_default_context(cafile=str(self.ca.cert_file))
        headers = {}
        if "client-certificate" in user:
            ctx.load_cert_chain(user["client-certificate"], user["client-key"])
        else:
            headers["Authorization"] = f"Bearer {user['token']}"
        return httpx.Client(base_url=self.url, verify=ctx, headers=headers, timeout=kwargs.pop("timeout", 30),
                            **kwargs)


def start_for_tests(workdir: Path) -> ControlPlane:
    """Start one for a test module. Without the binary: in CI (CI=true) the test fails; a developer's quick run may
    skip it with INFERSCALE_E2E_SKIP_CONTROL_PLANE=1; otherwise it fails saying how to build it."""
    import pytest

    if built() is None:
        how = "run `bash scripts/test.sh` (it builds the control plane first; see README, 'Two commands')"
        if os.environ.get("CI", "").lower() not in ("", "0", "false") or \
                os.environ.get("INFERSCALE_E2E_SKIP_CONTROL_PLANE") != "1":
            pytest.fail(f"the real control plane is not built: {how}", pytrace=False)
        pytest.skip(f"INFERSCALE_E2E_SKIP_CONTROL_PLANE=1 and the real control plane is not built ({how})")
    return ControlPlane(workdir).start()
