"""The platform on a real control plane: tenant namespaces (Pod Security `restricted`), `helm install` of
charts/inferscale (its CRD included), and the identities that act on it -- the operator's ServiceAccount token, and
per tenant one identity bound only in its own namespace (tenant A a user with a client certificate, tenant B a
ServiceAccount of its namespace)."""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path

from controlplane import ControlPlane
from e2e_common import ROOT, tool, wait_for

RELEASE, NAMESPACE = "inferscale", "inferscale-system"
JOBS_NAMESPACE = f"{NAMESPACE}-jobs"  # the chart's default encoder.namespace (it renders that Namespace)
OPERATOR_SA = "inferscale-operator"  # the chart's <fullname>-operator
TENANTS = ("tenant-a", "tenant-b")
# What a tenant may do in its own namespace: its UserMemory objects and what their memoriesFrom names.
TENANT_RULES = [{"apiGroups": ["inferscale.io"], "resources": ["usermemories"], "verbs": ["*"]},
                {"apiGroups": [""], "resources": ["configmaps", "secrets"], "verbs": ["*"]},
                {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "list", "watch"]}]


class Platform:
    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.kubectl_bin, self.helm_bin = tool("kubectl"), tool("helm")
        self.internal_token = "e2e-" + secrets.token_hex(16)
        self.tenant_kubeconfigs: dict[str, Path] = {}

    def kubectl(self, *args: str, kubeconfig: Path | None = None, check: bool = True,
                stdin: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.kubectl_bin, "--kubeconfig", str(kubeconfig or self.cp.admin_kubeconfig), *args],
                              capture_output=True, text=True, timeout=120, input=stdin)
        if check:
            assert proc.returncode == 0, f"kubectl {' '.join(args)}: rc={proc.returncode}\n{proc.stdout}{proc.stderr}"
        return proc

    def apply(self, obj: dict, kubeconfig: Path | None = None) -> None:
        self.kubectl("apply", "-f", "-", kubeconfig=kubeconfig, stdin=json.dumps(obj))

    def install(self, *helm_args: str) -> Platform:
        for tenant in TENANTS:
            self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": tenant, "labels": {
                "pod-security.kubernetes.io/enforce": "restricted"}}})  # nothing of InferScale runs there
        # The release namespace holds the platform's Secrets: restricted too (the chart refuses to install into it
        # unlabelled, podSecurity.requireReleaseNamespaceLabel); its own pods comply.
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": {
            "pod-security.kubernetes.io/enforce": "restricted"}}})
        for tenant in TENANTS:
            wait_for(lambda: self.cp.has_default_service_account(tenant), 60, f"{tenant}'s default ServiceAccount")
        proc = subprocess.run([
            self.helm_bin, "--kubeconfig", str(self.cp.admin_kubeconfig), "install", RELEASE,
            str(ROOT / "charts" / "inferscale"), "-n", NAMESPACE,
            "-f", str(ROOT / "charts/inferscale/values-cpu.yaml"), "--set", f"internalToken.value={self.internal_token}",
            "--set-json", "tenants=" + json.dumps(list(TENANTS)), *helm_args], capture_output=True, text=True,
            timeout=300)
        assert proc.returncode == 0, f"helm install: {proc.stdout}{proc.stderr}"
        self.operator_kubeconfig = self.cp.token_kubeconfig(NAMESPACE, OPERATOR_SA)
        self.tenant_kubeconfigs[TENANTS[0]] = self._tenant_user(TENANTS[0], "alice")
        self.tenant_kubeconfigs[TENANTS[1]] = self._tenant_service_account(TENANTS[1], "app")
        return self

    def _bind(self, tenant: str, subject: dict[str, str]) -> None:
        meta = {"name": "tenant", "namespace": tenant}
        self.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
                    "rules": TENANT_RULES})
        self.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
                    "subjects": [subject]})

    def _tenant_user(self, tenant: str, user: str) -> Path:
        self._bind(tenant, {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user})
        return self.cp.user_kubeconfig(f"user-{user}", user)

    def _tenant_service_account(self, tenant: str, name: str) -> Path:
        self.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": tenant}})
        self._bind(tenant, {"kind": "ServiceAccount", "name": name, "namespace": tenant})
        return self.cp.token_kubeconfig(tenant, name)
