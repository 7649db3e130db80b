"""TEST STAND-IN for kubelet (+ the Job controller) on one node, for the local e2e target. Not a kubelet.

It watches (polls) batch/v1 Jobs in the API server it is given, and for each new Job:
- creates the Job's Pod object (label `job-name`, `spec.nodeName` = this node) and marks it Running;
- "mounts" the volumes the way a container runtime would, by path: a `configMap` volume is written out to a
  temp dir, a `hostPath` volume is that path on this machine (the local filesystem plays the node's disk);
- runs the container's command as a subprocess, in `image_dir` (which plays the image: the model dir lives
  there), with the container's env (`fieldRef: spec.nodeName` resolved) and mount paths rewritten in its argv;
- writes the outcome back: Pod phase Succeeded/Failed, and Job status `succeeded` + `Complete`, or `failed` +
  `Failed` (with the last line of the command's stderr), as the Job controller would.
It records, per Job, the host paths it mounted (`handled[uid]["host_paths"]`): exactly the hostPath volumes the
manifest names, as a kubelet would, so a test can show what a Job's pod could see of the node's disk.
What it does not do: scheduling (every Job runs here, node selectors and GPU limits are ignored), image
pulls, init containers, isolation (the process could read more than its mounts), restarts/backoff, resource
limits, TTL cleanup.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx

from kubelet_standin import MERGE, now_rfc3339 as _now, rewrite_mount_path



class NodeAgentStandIn:
    def __init__(self, api_url: str, node: str, image_dir: Path, work_dir: Path, *, poll: float = 0.2,
                 run_timeout: float = 180.0) -> None:
        self.node, self.image_dir, self.work_dir = node, Path(image_dir), Path(work_dir)
        self.poll, self.run_timeout = poll, run_timeout
        self.http = httpx.Client(base_url=api_url, timeout=10)
        self.handled: dict[str, dict[str, Any]] = {}  # job uid -> {"name", "rc", "log"}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"node-agent-{node}")

    def start(self) -> NodeAgentStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.run_timeout + 10)
        self.http.close()

    # -- the loop ---------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                resp = self.http.get("/apis/batch/v1/jobs")
                if resp.status_code != 200:
                    continue
                for job in resp.json().get("items") or []:
                    uid = job["metadata"].get("uid") or job["metadata"]["name"]
                    if uid in self.handled or (job.get("status") or {}).get("conditions"):
                        continue
                    self._run_job(job, uid)
            except Exception as e:  # noqa: BLE001 - keep playing kubelet; the test reports `errors`
                self.errors.append(f"{type(e).__name__}: {e}")

    def _run_job(self, job: dict[str, Any], uid: str) -> None:
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        spec = job["spec"]["template"]["spec"]
        pod_dir = self.work_dir / f"{ns}-{name}"
        annotations = (job["spec"]["template"].get("metadata") or {}).get("annotations") or {}
        mounts = self._mount(ns, spec, pod_dir, annotations)
        if mounts is None:
            return  # a ConfigMap is not there yet: try again next round, like ContainerCreating
        container = spec["containers"][0]
        argv = [rewrite_mount_path(a, mounts) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
        if argv and argv[0] == "inferscale":  # the image's entry point = this venv's CLI
            argv = [sys.executable, "-m", "inferscale.cli", *argv[1:]]
        env = dict(os.environ)
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = str(var["value"])
            elif (var.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                env[var["name"]] = self.node
        pod = f"{name}-{uuid.uuid4().hex[:5]}"
        labels = {**(job["spec"]["template"].get("metadata") or {}).get("labels", {}), "job-name": name,
                  "batch.kubernetes.io/controller-uid": job["metadata"].get("uid", "")}
        # As the Job controller does: the pod's controller is the Job (the operator trusts no bare job-name label).
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"].get("uid", ""),
                 "controller": True, "blockOwnerDeletion": True}
        host_mounts = {m["mountPath"].rstrip("/") for m in container.get("volumeMounts") or []
                       if "hostPath" in {v["name"]: v for v in spec.get("volumes") or []}[m["name"]]}
        self._ok(self.http.post(f"/api/v1/namespaces/{ns}/pods", json={
            "metadata": {"name": pod, "namespace": ns, "labels": labels, "annotations": annotations,
                         "ownerReferences": [owner]},
            "spec": {**spec, "nodeName": self.node},
            "status": {"phase": "Running", "startTime": _now()}}))
        self._ok(self.http.patch(f"/apis/batch/v1/namespaces/{ns}/jobs/{name}/status", headers=MERGE,
                                 json={"status": {"active": 1, "startTime": _now()}}))
        log = pod_dir / "container.log"
        self.handled[uid] = {"name": name, "namespace": ns, "rc": None, "log": log, "argv": argv,
                             "host_paths": sorted(str(p) for mp, p in mounts.items() if mp in host_mounts)}
        with open(log, "wb") as out:
            try:
                rc = subprocess.run(argv, cwd=self.image_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    timeout=self.run_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 137
        self.handled[uid]["rc"] = rc
        last = next((ln for ln in reversed(log.read_text(errors="replace").splitlines()) if ln.strip()), "")
        self._ok(self.http.patch(f"/api/v1/namespaces/{ns}/pods/{pod}/status", headers=MERGE, json={
            "status": {"phase": "Succeeded" if rc == 0 else "Failed"}}))
        if rc == 0:
            status = {"active": 0, "succeeded": 1, "completionTime": _now(), "conditions": [
                {"type": "SuccessCriteriaMet", "status": "True", "lastTransitionTime": _now()},
                {"type": "Complete", "status": "True", "lastTransitionTime": _now()}]}
        else:
            status = {"active": 0, "failed": 1, "conditions": [
                {"type": "Failed", "status": "True", "reason": "PodFailurePolicy" if rc == 2 else "BackoffLimitExceeded",
                 "message": f"Container encode exited with code {rc}: {last[:300]}", "lastTransitionTime": _now()}]}
        self._ok(self.http.patch(f"/apis/batch/v1/namespaces/{ns}/jobs/{name}/status", headers=MERGE,
                                 json={"status": status}))

    def _mount(self, ns: str, spec: dict[str, Any], pod_dir: Path,
               annotations: dict[str, str]) -> dict[str, Path] | None:
        """mountPath -> local directory, or None when a ConfigMap volume's object does not exist yet."""
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        out: dict[str, Path] = {}
        for m in spec["containers"][0].get("volumeMounts") or []:
            vol = volumes[m["name"]]
            if "configMap" in vol:
                resp = self.http.get(f"/api/v1/namespaces/{ns}/configmaps/{vol['configMap']['name']}")
                if resp.status_code == 404:
                    return None
                data = self._ok(resp).get("data") or {}
                local = pod_dir / "volumes" / m["name"]
                local.mkdir(parents=True, exist_ok=True)
                for key, text in data.items():
                    (local / key).write_text(text)
            elif "hostPath" in vol:
                local = Path(vol["hostPath"]["path"])  # this machine's filesystem is the node's
                local.mkdir(parents=True, exist_ok=True)
            elif "emptyDir" in vol:
                local = pod_dir / "volumes" / m["name"]
                local.mkdir(parents=True, exist_ok=True)
            elif "downwardAPI" in vol:  # the upload credential: the pod template's annotation
                local = pod_dir / "volumes" / m["name"]
                local.mkdir(parents=True, exist_ok=True)
                for item in vol["downwardAPI"]["items"]:
                    key = item["fieldRef"]["fieldPath"].split("'")[1]  # metadata.annotations['<key>']
                    (local / item["path"]).write_text(annotations.get(key, ""))
                    (local / item["path"]).chmod(0o400)
            elif "secret" in vol:  # the KEK: a kubelet writes each key as a file, base64-decoded
                resp = self.http.get(f"/api/v1/namespaces/{ns}/secrets/{vol['secret']['secretName']}")
                if resp.status_code == 404:
                    return None
                data = self._ok(resp).get("data") or {}
                local = pod_dir / "volumes" / m["name"]
                local.mkdir(parents=True, exist_ok=True)
                for key, b64 in data.items():
                    (local / key).write_bytes(base64.b64decode(b64))
                    (local / key).chmod(0o400)
            else:
                raise ValueError(f"volume {m['name']}: only configMap, secret, downwardAPI, hostPath and emptyDir are "
                                 "emulated")
            out[m["mountPath"].rstrip("/")] = local
        pod_dir.mkdir(parents=True, exist_ok=True)
        return out

    @staticmethod
    def _ok(resp: httpx.Response) -> dict[str, Any]:
        if resp.status_code >= 300:
            raise RuntimeError(f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text[:300]}")
        return resp.json()
