"""The real-cluster target (only when KUBECONFIG is set): `helm install` of charts/inferscale with values-cpu.yaml,
then the same scenario against the real operator, encode Job, serving pod and API server.

Knobs (environment): INFERSCALE_E2E_RELEASE / INFERSCALE_E2E_NAMESPACE (release and its namespace, default
inferscale-e2e), INFERSCALE_E2E_HELM_ARGS (extra helm args, e.g. `--set image.repository=... --set image.tag=...`),
INFERSCALE_E2E_KEEP=1 (leave the release and tenant namespace installed), INFERSCALE_E2E_READY_TIMEOUT (s, 900).
The tenants are two fresh namespaces `e2e-<random>` and `e2e-<random>-b` (the chart's `tenants` allow-list); their API
keys go into the release's tenants file. Encode Jobs run in `<namespace>-jobs` (the chart's default encoder.namespace,
which it renders and keeps on uninstall; close() deletes it). Spans are read
from the serving pod's log: the servers get INFERSCALE_CONSOLE_TRACES=true and OTEL_SDK_DISABLED=false (env wins
over the chart's envFrom ConfigMap).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

from e2e_common import ROOT, chart_tls, parse_console_spans, stop_process, tool, wait_for


class ClusterTarget:
    name = "cluster"
    model = "gemma-3-270m"  # the chart's model.name
    apply_flags: list[str] = []

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.release = os.environ.get("INFERSCALE_E2E_RELEASE", "inferscale-e2e")
        self.namespace = os.environ.get("INFERSCALE_E2E_NAMESPACE", "inferscale-e2e")
        self.jobs_namespace = f"{self.namespace}-jobs"
        self.tenant = "e2e-" + secrets.token_hex(3)
        self.tenant_b = self.tenant + "-b"
        self.api_key = "isk-e2e-" + secrets.token_urlsafe(16)
        self.api_key_b = "isk-e2e-" + secrets.token_urlsafe(16)
        self.internal_token = "e2e-" + secrets.token_hex(16)
        self.ready_timeout = float(os.environ.get("INFERSCALE_E2E_READY_TIMEOUT", "900"))
        self.gone_timeout = 180.0
        self.keep = os.environ.get("INFERSCALE_E2E_KEEP") == "1"
        self._forwards: dict[str, tuple[subprocess.Popen, str]] = {}
        self._installed = False
        self.tls: Any = None  # the chart's TLS, as clients of the internal API verify it (after start)

    def start(self) -> ClusterTarget:
        from inferscale.server.auth import hash_key

        self.kubectl_bin, self.helm_bin = tool("kubectl"), tool("helm")
        for tenant in (self.tenant, self.tenant_b):
            self.kubectl("create", "namespace", tenant)
            # Tenant namespaces stay at Pod Security restricted: nothing of InferScale runs there.
            self.kubectl("label", "namespace", tenant, "pod-security.kubernetes.io/enforce=restricted")
        # The release namespace too (it holds the platform's Secrets; the chart refuses it unlabelled).
        self.kubectl("create", "namespace", self.namespace)
        self.kubectl("label", "namespace", self.namespace, "pod-security.kubernetes.io/enforce=restricted")
        extra_env = [{"name": "OTEL_SDK_DISABLED", "value": "false"},
                     {"name": "INFERSCALE_CONSOLE_TRACES", "value": "true"}]
        self._installed = True
        self._run([self.helm_bin, "upgrade", "--install", self.release, str(ROOT / "charts" / "inferscale"),
                   "-n", self.namespace, "-f", str(ROOT / "charts/inferscale/values-cpu.yaml"),
                   "--set", f"internalToken.value={self.internal_token}",
                   "--set-json", "apiKeys.tenants=" + json.dumps({self.tenant: [hash_key(self.api_key)],
                                                                  self.tenant_b: [hash_key(self.api_key_b)]}),
                   "--set-json", "tenants=" + json.dumps([self.tenant, self.tenant_b]),
                   "--set-json", "server.extraEnv=" + json.dumps(extra_env),
                   "--set", "operator.jobPollSeconds=2",
                   "--wait", "--timeout", "20m", *shlex.split(os.environ.get("INFERSCALE_E2E_HELM_ARGS", ""))],
                  timeout=1300)
        self.tls = self._chart_tls()
        return self

    def _chart_tls(self) -> Any:
        """The release's TLS (its default) as the operator verifies it: the CA of its TLS Secret (kubernetes.io/tls
        with ca.crt) and the servers' INFERSCALE_TLS_SERVER_NAME; None when installed without TLS."""
        release = f"app.kubernetes.io/instance={self.release}"
        configs = self._json("get", "configmaps", "-n", self.namespace, "-l",
                             f"{release},app.kubernetes.io/component=server") or {}
        name = next((c["data"]["INFERSCALE_TLS_SERVER_NAME"] for c in configs.get("items") or []
                     if "INFERSCALE_TLS_SERVER_NAME" in (c.get("data") or {})), None)
        if name is None:
            return None
        secrets_ = (self._json("get", "secrets", "-n", self.namespace, "-l", release) or {}).get("items") or []
        (secret,) = [s for s in secrets_ if "ca.crt" in (s.get("data") or {}) and "tls.key" in s["data"]]
        return chart_tls(secret["data"], name, self.workdir / "tls")

    def close(self) -> None:
        for proc, _ in self._forwards.values():
            stop_process(proc)
        if self.keep:
            return
        for tenant in (self.tenant, self.tenant_b):
            self._run([self.kubectl_bin, "delete", "namespace", tenant, "--wait=false", "--ignore-not-found"],
                      check=False)
        if self._installed:
            self._run([self.helm_bin, "uninstall", self.release, "-n", self.namespace, "--wait", "--timeout", "5m"],
                      check=False, timeout=400)
            self._run([self.kubectl_bin, "delete", "namespace", self.jobs_namespace, "--wait=false",
                       "--ignore-not-found"], check=False)

    # -- what the test uses -----------------------------------------------------------------------------------
    def _run(self, argv: list[str], check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"{' '.join(argv)}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def kubectl(self, *args: str) -> subprocess.CompletedProcess:
        return self._run([self.kubectl_bin, *args])

    def _json(self, *args: str) -> dict[str, Any] | None:
        proc = self._run([self.kubectl_bin, *args, "-o", "json"], check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr:
                return None
            raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr}")
        return json.loads(proc.stdout)

    def get_um(self, name: str, tenant: str | None = None) -> dict[str, Any] | None:
        return self._json("get", "usermemories.inferscale.io", name, "-n", tenant or self.tenant)

    def events(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return list((self._json("get", "events", "-n", tenant or self.tenant) or {}).get("items") or [])

    def jobs(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Jobs in a namespace; by default the Jobs' namespace, where the operator runs them."""
        return list((self._json("get", "jobs", "-n", namespace or self.jobs_namespace) or {}).get("items") or [])

    def job_host_paths(self, job: dict[str, Any]) -> list[str]:
        """The node paths kubelet mounts into the Job's pod: its hostPath volumes (init containers included)."""
        return [v["hostPath"]["path"] for v in job["spec"]["template"]["spec"].get("volumes") or [] if "hostPath" in v]

    def endpoint(self, placement: dict[str, Any]) -> str:
        """http://127.0.0.1:<port> forwarded to the tenant port of the pod that holds the blocks."""
        return self._forward(placement, 8000)

    def internal_endpoint(self, placement: dict[str, Any]) -> str:
        """Forwarded to the pod's internal port (a port-forward is not subject to the NetworkPolicy); https with the
        chart's TLS (e2e_common.internal_get verifies the certificate for the fleet's name)."""
        url = self._forward(placement, 8001)
        return url.replace("http://", "https://", 1) if self.tls is not None else url

    def _forward(self, placement: dict[str, Any], pod_port: int) -> str:
        key = f"{placement['namespace']}/{placement['pod']}:{pod_port}"
        if key not in self._forwards:
            log = self.workdir / f"port-forward-{placement['pod']}-{pod_port}.log"
            out = open(log, "w")
            proc = subprocess.Popen([self.kubectl_bin, "port-forward", "-n", placement["namespace"],
                                     f"pod/{placement['pod']}", f":{pod_port}"], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
            self._forwards[key] = (proc, "")

            def port() -> str | None:
                assert proc.poll() is None, f"kubectl port-forward exited: {log.read_text()}"
                m = re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", log.read_text())
                return m.group(1) if m else None

            self._forwards[key] = (proc, f"http://127.0.0.1:{wait_for(port, 60, 'kubectl port-forward')}")
            time.sleep(0.5)
        return self._forwards[key][1]

    def spans(self, placement: dict[str, Any]) -> list[dict[str, Any]]:
        proc = self._run([self.kubectl_bin, "logs", "-n", placement["namespace"], placement["pod"], "-c", "server",
                          "--tail=-1"], timeout=60)
        return parse_console_spans(proc.stdout)

    def store_blobs(self, placement: dict[str, Any], user: str) -> list[str]:
        script = ("import os,pathlib,sys; from inferscale.kvformat import SUFFIX; r=pathlib.Path(os.environ.get('INFERSCALE_DATA_DIR','/var/lib/inferscale/data'))"
                  "/'store'; print('\\n'.join(str(p) for p in (r/sys.argv[1]/sys.argv[2]).rglob('*'+SUFFIX)))")
        proc = self.kubectl("exec", "-n", placement["namespace"], placement["pod"], "-c", "server", "--",
                            "python", "-c", script, self.tenant, user)
        return sorted(line for line in proc.stdout.splitlines() if line.strip())

    def diag(self) -> str:
        parts = []
        for args in (["get", "usermemories.inferscale.io", "-n", self.tenant, "-o", "wide"],
                     ["get", "jobs,pods", "-n", self.jobs_namespace, "-o", "wide"],
                     ["get", "events", "-n", self.tenant, "--sort-by=.lastTimestamp"],
                     ["get", "pods", "-n", self.namespace, "-o", "wide"],
                     ["logs", "-n", self.namespace, "-l", "app.kubernetes.io/component=operator", "--tail=60"]):
            proc = self._run([self.kubectl_bin, *args], check=False, timeout=60)
            parts.append(f"--- kubectl {' '.join(args)}\n{proc.stdout}{proc.stderr}")
        return "\n".join(parts)
