"""TEST STAND-IN for a kubelet on one node of the real control plane (controlplane.py). Not a kubelet: the one fake
left in the loop, because no container runtime can run here.

What it does, as the node's own identity (client certificate `system:node:<node>`, group `system:nodes`, so the
Node authorizer and NodeRestriction limit it as they limit a kubelet):
- registers its Node (labels, `nvidia.com/gpu` capacity, an InternalIP) and keeps it Ready: a Lease in
  kube-node-lease renewed and a status heartbeat every `heartbeat` seconds;
- runs each pod the real scheduler binds to it as local processes: init containers one after another, then the
  containers; the argv is `command` + `args` with `$(VAR)` expanded, `inferscale`/`python` mean this venv;
- volumes by path, the way a runtime mounts them: `hostPath` is that path under `host_root` (the node's disk),
  `emptyDir` a fresh dir, `configMap`/`secret` written out as files (Secrets base64-decoded), `projected` with
  the pod's ServiceAccount token (a TokenRequest bound to the pod), `kube-root-ca.crt` and downward-API files;
  mount paths in argv and env values are rewritten to those dirs (a process cannot see a mount namespace);
- env: `value`, `fieldRef` (metadata.name/namespace, spec.nodeName, status.podIP), `secretKeyRef`,
  `configMapKeyRef`, `envFrom`; a pod with a ServiceAccount token gets KUBECONFIG pointing at the API server with
  that token (in-cluster discovery needs KUBERNETES_SERVICE_HOST, which has no kube-proxy behind it here), and
  an env value `0.0.0.0` (bind everything) becomes the pod's IP, as inside a pod's own network namespace;
- readiness: Ready once each container's httpGet readinessProbe answers on the pod's IP;
- writes back what a kubelet writes: phase, pod IP (the node's), conditions, container states and exit codes;
  deletes a terminating pod once its processes are gone.
What it does not: isolation (a process could read more than its mounts), image pulls, resource limits, liveness
and startup probes, restarts (an exited container of a `restartPolicy: Always` pod ends the pod as Failed), port
mapping (a pod's process binds what it binds, on the node's IP), exec/logs/port-forward (no kubelet API: tests
read the logs and reach the ports directly).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from controlplane import ControlPlane

MERGE = {"Content-Type": "application/merge-patch+json"}
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_FILE_MODE = 0o644  # a configMap/secret volume's defaultMode when the pod names none (Kubernetes' default)


def now_rfc3339(micro: bool = False) -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro
                                                                 else "%Y-%m-%dT%H:%M:%SZ")


class MissingObject(Exception):
    """A ConfigMap/Secret a pod needs is not there yet: the pod waits, as in ContainerCreating."""


class KubeletStandIn:
    def __init__(self, cp: ControlPlane, node: str, *, ip: str, image_dir: Path, work_dir: Path,
                 labels: dict[str, str], gpus: int, host_root: Path | None = None, heartbeat: float = 5.0,
                 taints: list[dict[str, str]] | None = None) -> None:
        self.cp, self.node, self.ip = cp, node, ip
        self.image_dir, self.work_dir = Path(image_dir), Path(work_dir)
        self.host_root = Path(host_root) if host_root else None
        self.labels, self.gpus, self.heartbeat, self.taints = labels, gpus, heartbeat, taints or []
        self.kubeconfig = cp.user_kubeconfig(f"node-{node}", f"system:node:{node}", ("system:nodes",))
        self.http = cp.client(self.kubeconfig)
        self.pods: dict[str, dict[str, Any]] = {}  # uid -> {"name", "namespace", "procs", "logs", "host_paths", "rc"}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat, daemon=True, name=f"kubelet-{node}-beat"),
                         threading.Thread(target=self._sync, daemon=True, name=f"kubelet-{node}-pods")]

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> KubeletStandIn:
        self._ok(self.http.post("/api/v1/nodes", json={"metadata": {"name": self.node, "labels": {
            "kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux", **self.labels}},
            "spec": {"taints": self.taints}}))
        self._heartbeat()
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for info in list(self.pods.values()):
            self._kill(info)
        for t in self._threads:
            t.join(15)
        self.http.close()

    # -- the node: Lease and status ---------------------------------------------------------------------------
    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            self._guard(self._heartbeat)

    def _heartbeat(self) -> None:
        lease_url = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node}"
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": 40, "renewTime": now_rfc3339(micro=True)}
        resp = self.http.get(lease_url)
        if resp.status_code == 404:
            self._ok(self.http.post("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                                    json={"metadata": {"name": self.node}, "spec": spec}))
        else:
            lease = self._ok(resp)
            lease["spec"].update(spec)
            self._ok(self.http.put(lease_url, json=lease))
        capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi",
                    "nvidia.com/gpu": str(self.gpus)}
        conditions = [{"type": t, "status": "False", "reason": f"KubeletHas{r}", "lastHeartbeatTime": now_rfc3339(),
                       "lastTransitionTime": now_rfc3339()} for t, r in (("MemoryPressure", "SufficientMemory"),
                                                                  ("DiskPressure", "NoDiskPressure"),
                                                                  ("PIDPressure", "SufficientPID"))]
        conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now_rfc3339(),
                           "lastTransitionTime": now_rfc3339(), "message": "kubelet stand-in is posting ready status"})
        self._ok(self.http.patch(f"/api/v1/nodes/{self.node}/status", headers=MERGE, json={"status": {
            "capacity": capacity, "allocatable": capacity, "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": self.ip}, {"type": "Hostname", "address": self.node}],
            "nodeInfo": {"kubeletVersion": "v1.37.2-standin", "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "standin://local-processes", "kernelVersion": "", "osImage": "",
                         "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""}}}))

    # -- pods -------------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        while not self._stop.wait(0.3):
            self._guard(self._sync_once)

    def _sync_once(self) -> None:
        listed = self._ok(self.http.get("/api/v1/pods", params={"fieldSelector": f"spec.nodeName={self.node}"}))
        for pod in listed.get("items") or []:
            meta, phase = pod["metadata"], (pod.get("status") or {}).get("phase")
            uid = meta["uid"]
            if meta.get("deletionTimestamp"):
                self._terminate(pod)
            elif uid not in self.pods and phase in (None, "Pending"):
                try:
                    volumes = self._volumes(pod)
                except MissingObject:
                    continue
                with self._lock:
                    self.pods[uid] = {"name": meta["name"], "namespace": meta["namespace"], "procs": {}, "rc": {},
                                      "logs": {}, "host_paths": sorted(str(volumes[v["name"]])
                                                                       for v in pod["spec"].get("volumes") or []
                                                                       if "hostPath" in v)}
                threading.Thread(target=self._guard, args=(self._run_pod, pod, volumes), daemon=True,
                                 name=f"pod-{meta['name']}").start()

    def _terminate(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        info = self.pods.get(meta["uid"])
        if info is not None:
            self._kill(info)
        resp = self.http.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                 json={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        if resp.status_code not in (200, 404, 409):
            self._ok(resp)

    def _run_pod(self, pod: dict[str, Any], volumes: dict[str, Path]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        info = self.pods[meta["uid"]]
        for c in spec.get("initContainers") or []:
            if self._run_container(pod, c, volumes, info).wait() != 0:
                return self._finish(pod, info, init_failed=c["name"])
        procs = {c["name"]: self._run_container(pod, c, volumes, info) for c in spec["containers"]}
        probes = [(c, c["readinessProbe"]["httpGet"]) for c in spec["containers"]
                  if (c.get("readinessProbe") or {}).get("httpGet")]
        self._status(pod, "Running", ready=not probes, info=info)
        if probes:
            self._wait_ready(probes, procs)
            self._status(pod, "Running", ready=True, info=info)
        for name, proc in procs.items():
            info["rc"][name] = proc.wait()
        self._finish(pod, info)

    def _wait_ready(self, probes: list[tuple[dict[str, Any], dict[str, Any]]], procs: dict[str, Any]) -> None:
        """Ready once every readiness probe (httpGet) answers 2xx on the pod's IP, as a kubelet's prober decides."""
        def port(c: dict[str, Any], ref: Any) -> Any:
            return next((p["containerPort"] for p in c.get("ports") or [] if p.get("name") == ref), ref)

        pending = list(probes)
        while pending and not self._stop.wait(0.5):
            if any(p.poll() is not None for p in procs.values()):
                return
            c, get = pending[0]
            try:
                if httpx.get(f"http://{self.ip}:{port(c, get['port'])}{get.get('path', '/')}", timeout=2).is_success:
                    pending.pop(0)
            except httpx.HTTPError:
                pass

    def _finish(self, pod: dict[str, Any], info: dict[str, Any], init_failed: str | None = None) -> None:
        failed = init_failed or any(rc != 0 for rc in info["rc"].values())
        if pod["spec"].get("restartPolicy", "Always") == "Always":
            failed = True  # no restarts here: a long-running container that exited is a failed pod
        self._status(pod, "Failed" if failed else "Succeeded", ready=False, info=info)

    def _status(self, pod: dict[str, Any], phase: str, ready: bool, info: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if self._stop.is_set():
            return

        def state(name: str) -> dict[str, Any]:
            if name in info["rc"]:
                rc = info["rc"][name]
                return {"terminated": {"exitCode": rc, "reason": "Completed" if rc == 0 else "Error",
                                       "startedAt": info.get("started", now_rfc3339()), "finishedAt": now_rfc3339()}}
            return {"running": {"startedAt": info.setdefault("started", now_rfc3339())}}

        conditions = [{"type": t, "status": "True" if (ready or t in ("PodScheduled", "Initialized")) else "False",
                       "lastTransitionTime": now_rfc3339()} for t in ("PodScheduled", "Initialized", "ContainersReady",
                                                                "Ready")]
        status = {"phase": phase, "podIP": self.ip, "podIPs": [{"ip": self.ip}], "hostIP": self.ip,
                  "hostIPs": [{"ip": self.ip}], "startTime": info.setdefault("started", now_rfc3339()),
                  "conditions": conditions,
                  "containerStatuses": [{"name": c["name"], "image": c.get("image", ""), "imageID": "",
                                         "ready": ready and c["name"] not in info["rc"], "restartCount": 0,
                                         "started": c["name"] not in info["rc"], "state": state(c["name"])}
                                        for c in pod["spec"]["containers"]]}
        resp = self.http.patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                               headers=MERGE, json={"status": status})
        if resp.status_code != 404:
            self._ok(resp)

    def _run_container(self, pod: dict[str, Any], c: dict[str, Any], volumes: dict[str, Path],
                       info: dict[str, Any]) -> subprocess.Popen:
        mounts = {m["mountPath"].rstrip("/"): volumes[m["name"]] / m.get("subPath", "")
                  for m in c.get("volumeMounts") or []}
        env = self._env(pod, c, mounts)
        argv = [self._expand(a, env) for a in [*(c.get("command") or ["inferscale"]), *(c.get("args") or [])]]
        argv = [rewrite_mount_path(a, mounts) for a in argv]
        if argv[0] == "inferscale":  # the image's entry point = this venv's CLI
            argv = [sys.executable, "-m", "inferscale.cli", *argv[1:]]
        elif argv[0] in ("python", "python3"):
            argv = [sys.executable, *argv[1:]]
        log = self.work_dir / f"{pod['metadata']['namespace']}-{pod['metadata']['name']}-{c['name']}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        info["logs"][c["name"]] = log
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, cwd=self.image_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        info["procs"][c["name"]] = proc
        return proc

    def _kill(self, info: dict[str, Any]) -> None:
        from e2e_common import stop_process

        for proc in list(info["procs"].values()):
            stop_process(proc, grace=5)

    # -- what a pod sees: env and volumes ---------------------------------------------------------------------
    def _env(self, pod: dict[str, Any], c: dict[str, Any], mounts: dict[str, Path]) -> dict[str, str]:
        meta, ns = pod["metadata"], pod["metadata"]["namespace"]
        env = {"PYTHONUNBUFFERED": "1", "HOSTNAME": meta["name"]}  # what the pod spec sets, rewritten below
        fields = {"metadata.name": meta["name"], "metadata.namespace": ns, "spec.nodeName": self.node,
                  "status.podIP": self.ip, "status.hostIP": self.ip,
                  "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "")}
        for source in c.get("envFrom") or []:
            ref = source.get("configMapRef") or source.get("secretRef")
            data = self._data(ns, "configmaps" if "configMapRef" in source else "secrets", ref["name"],
                              optional=ref.get("optional", False))
            env.update({source.get("prefix", "") + k: v for k, v in data.items()})
        for var in c.get("env") or []:
            src = var.get("valueFrom") or {}
            if "value" in var:
                env[var["name"]] = self._expand(str(var["value"]), env)
            elif "fieldRef" in src:
                env[var["name"]] = fields[src["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in src or "configMapKeyRef" in src:
                ref = src.get("secretKeyRef") or src["configMapKeyRef"]
                data = self._data(ns, "secrets" if "secretKeyRef" in src else "configmaps", ref["name"],
                                  optional=ref.get("optional", False))
                if ref["key"] in data:
                    env[var["name"]] = data[ref["key"]]
        # A pod's "all interfaces" are its own network namespace's: here, the pod's (the node's) IP.
        env = {k: self.ip if v == "0.0.0.0" else rewrite_mount_path(v, mounts) for k, v in env.items()}
        # Then what the stand-in adds, not rewritten (its own paths may well lie under a mount path like /tmp): this
        # machine's environment (the venv, offline flags) and the ServiceAccount's kubeconfig.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSCALE_", "OTEL_", "KUBERNETES_",
                                                                               "KUBECONFIG"))}
        env = {**inherited, **env}
        if SA_MOUNT in mounts:
            token = mounts[SA_MOUNT] / "token"
            kubeconfig = token.parent / "kubeconfig"
            kubeconfig.write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "pod",
                "clusters": [{"name": "e2e", "cluster": {"server": self.cp.url,
                                                         "certificate-authority": str(self.cp.ca.cert_file)}}],
                "users": [{"name": "pod", "user": {"token": token.read_text()}}],
                "contexts": [{"name": "pod", "context": {"cluster": "e2e", "user": "pod",
                                                         "namespace": meta["namespace"]}}]}))
            env["KUBECONFIG"] = str(kubeconfig)
        return env

    @staticmethod
    def _expand(value: str, env: dict[str, str]) -> str:
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)

    def _data(self, ns: str, kind: str, name: str, optional: bool = False) -> dict[str, str]:
        resp = self.http.get(f"/api/v1/namespaces/{ns}/{kind}/{name}")
        if resp.status_code == 404:
            if optional:
                return {}
            raise MissingObject(f"{kind}/{name}")
        obj = self._ok(resp)
        if kind == "secrets":
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
        return dict(obj.get("data") or {})

    def _volumes(self, pod: dict[str, Any]) -> dict[str, Path]:
        meta = pod["metadata"]
        pod_dir = self.work_dir / "pods" / meta["uid"]
        out = {}
        for vol in pod["spec"].get("volumes") or []:
            local = pod_dir / "volumes" / vol["name"]
            if "hostPath" in vol:
                path = vol["hostPath"]["path"]
                local = (self.host_root / path.lstrip("/")) if self.host_root else Path(path)
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in vol or "secret" in vol:
                ref = vol.get("configMap") or vol["secret"]
                self._write_files(local, self._data(meta["namespace"], "configmaps" if "configMap" in vol
                                                    else "secrets", ref.get("name") or ref["secretName"],
                                                    optional=ref.get("optional", False)), ref.get("items"),
                                  ref.get("defaultMode", DEFAULT_FILE_MODE))
            elif "downwardAPI" in vol:  # an encode Job's upload credential (its pod's annotation)
                _downward(meta, vol["downwardAPI"].get("items") or [], local,
                          vol["downwardAPI"].get("defaultMode", DEFAULT_FILE_MODE))
            elif "projected" in vol:
                for source in vol["projected"]["sources"]:
                    self._project(pod, source, local, vol["projected"].get("defaultMode", DEFAULT_FILE_MODE))
            out[vol["name"]] = local
        return out

    def _project(self, pod: dict[str, Any], source: dict[str, Any], local: Path, mode: int) -> None:
        meta = pod["metadata"]
        if "serviceAccountToken" in source:
            sa = pod["spec"].get("serviceAccountName", "default")
            spec = {"expirationSeconds": source["serviceAccountToken"].get("expirationSeconds", 3600),
                    "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]}}
            if aud := source["serviceAccountToken"].get("audience"):
                spec["audiences"] = [aud]
            resp = self._ok(self.http.post(f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token",
                                           json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                                 "spec": spec}))
            (local / source["serviceAccountToken"]["path"]).write_text(resp["status"]["token"])
        elif "configMap" in source or "secret" in source:
            ref = source.get("configMap") or source["secret"]
            kind = "configmaps" if "configMap" in source else "secrets"
            self._write_files(local, self._data(meta["namespace"], kind, ref["name"],
                                                optional=ref.get("optional", False)), ref.get("items"), mode)
        elif "downwardAPI" in source:
            _downward(meta, source["downwardAPI"].get("items") or [], local, mode)

    @staticmethod
    def _write_files(local: Path, data: dict[str, str], items: list[dict[str, Any]] | None, mode: int) -> None:
        """Each key as a file with the volume's defaultMode, or its item's own mode, as the kubelet writes them (the
        server refuses a secret file other users can read, so the modes matter)."""
        keys = {i["key"]: (i["path"], i.get("mode", mode)) for i in items} if items else {k: (k, mode) for k in data}
        for key, (path, file_mode) in keys.items():
            if key in data:
                (local / path).parent.mkdir(parents=True, exist_ok=True)
                (local / path).write_text(data[key])
                (local / path).chmod(file_mode)

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - keep playing kubelet; tests read `errors`
            self.errors.append(f"{type(e).__name__}: {e}")

    @staticmethod
    def _ok(resp: httpx.Response) -> dict[str, Any]:
        if resp.status_code >= 300:
            raise RuntimeError(f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text[:300]}")
        return resp.json()


def rewrite_mount_path(arg: str, mounts: dict[str, Path]) -> str:
    """A path under a mount point, as the local dir that plays the mount."""
    for mp in sorted(mounts, key=len, reverse=True):
        if arg == mp or arg.startswith(mp + "/"):
            return str(mounts[mp]) + arg[len(mp):]
    return arg


def _downward(meta: dict[str, Any], items: list[dict[str, Any]], local: Path, mode: int) -> None:
    """downwardAPI files: the pod's name, namespace, or one of its annotations (`metadata.annotations['k']`)."""
    for item in items:
        field = (item.get("fieldRef") or {}).get("fieldPath", "")
        found = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", field)
        value = ((meta.get("annotations") or {}).get(found.group(1), "") if found else
                 {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"]}.get(field, ""))
        (local / item["path"]).write_text(value)
        (local / item["path"]).chmod(item.get("mode", mode))
