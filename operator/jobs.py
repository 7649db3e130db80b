"""Encoding Jobs: the manifests (pure functions) and how to read a Job's outcome.

A Job is named after the content hash and the ids it encodes, so a restarted operator derives the same
name and a create answered 409 means "already there": no duplicate Job, whatever the crash point. The
Job is self-describing (command, volumes) so a local harness can play kubelet from the API alone.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from inferscale.contract import DEFAULT_KV_DTYPE

from .settings import LABEL_MANAGED_BY, LABEL_TENANT, LABEL_USERMEMORY, MANAGED_BY, Settings
from .spec import Item

ITEMS_MOUNT = "/memories"
ITEMS_KEY = "items.jsonl"
HOSTNAME_LABEL = "kubernetes.io/hostname"

JobPhase = Literal["Running", "Succeeded", "Failed"]


def job_name(cr_name: str, content_hash: str, ids: Iterable[str]) -> str:
    digest = hashlib.sha256(json.dumps([content_hash, sorted(ids)]).encode()).hexdigest()[:10]
    # Job names end up in the `job-name` label of its pods: 63 characters at most.
    prefix = cr_name[:40].rstrip("-.")
    return f"{prefix}-enc-{digest}"


def kv_dir(settings: Settings, tenant: str, user_id: str) -> str:
    return posixpath.join(settings.kv_host_path, tenant, user_id)


def labels(tenant: str, cr_name: str) -> dict[str, str]:
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_TENANT: tenant, LABEL_USERMEMORY: cr_name[:63]}


def configmap_manifest(name: str, tenant: str, cr_name: str, items: Iterable[Item]) -> dict[str, Any]:
    jsonl = "".join(json.dumps(item.as_json(), ensure_ascii=False) + "\n" for item in items)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": tenant, "labels": labels(tenant, cr_name)},
        "data": {ITEMS_KEY: jsonl},
    }


def job_manifest(name: str, tenant: str, cr_name: str, user_id: str, model: str,
                 ids: Iterable[str], settings: Settings) -> dict[str, Any]:
    out = kv_dir(settings, tenant, user_id)
    command = ["inferscale", "encode", f"{ITEMS_MOUNT}/{ITEMS_KEY}", "--out", out, "--model", model,
               "--only", ",".join(sorted(ids)), "--embed"]
    if settings.kv_dtype != DEFAULT_KV_DTYPE:
        command += ["--kv-dtype", settings.kv_dtype]
    resources: dict[str, Any] = {}
    if settings.encoder_gpus > 0:
        resources = {"limits": {"nvidia.com/gpu": str(settings.encoder_gpus)}}  # a quantity: a string
    container: dict[str, Any] = {
        "name": "encode",
        "image": settings.encoder_image,
        "command": command,
        "env": [{"name": "INFERSCALE_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "resources": resources,
        "volumeMounts": [
            {"name": "memories", "mountPath": ITEMS_MOUNT, "readOnly": True},
            {"name": "kv", "mountPath": settings.kv_host_path},
        ],
    }
    return _job(name, tenant, cr_name, {
        # A bad item exits 2 and would fail again: retrying only burns GPU time.
        "backoffLimit": 1,
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": "encode", "operator": "In", "values": [2]}},
        ]},
        "ttlSecondsAfterFinished": 86400,
    }, {
        "nodeSelector": dict(settings.encoder_node_selector),
        "tolerations": [dict(t) for t in settings.encoder_tolerations],
        "containers": [container],
        "volumes": [{"name": "memories", "configMap": {"name": name}}, _kv_volume(settings)],
    })


def job_phase(job: Mapping[str, Any]) -> tuple[JobPhase, str]:
    """The Job's outcome and, when it failed, why (from its Failed condition)."""
    status = job.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") in ("Complete", "SuccessCriteriaMet"):
            return "Succeeded", ""
        if cond.get("type") in ("Failed", "FailureTarget"):
            return "Failed", cond.get("message") or cond.get("reason") or "the Job failed"
    if status.get("succeeded"):
        return "Succeeded", ""
    return "Running", ""


def job_node(job: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> str:
    """The node the Job ran on: its pod's nodeName if known, else its node selector's hostname."""
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            return str(node)
    selector = (((job.get("spec") or {}).get("template") or {}).get("spec") or {}).get("nodeSelector") or {}
    return str(selector.get(HOSTNAME_LABEL, ""))


def cleanup_job_name(cr_name: str, cr_uid: str, node: str) -> str:
    # The uid is in the hash: a later namesake UserMemory must not find this one's finished Job.
    digest = hashlib.sha256(json.dumps([cr_uid, node]).encode()).hexdigest()[:10]
    prefix = cr_name[:40].rstrip("-.")
    return f"{prefix}-clean-{digest}"


def cleanup_job_manifest(name: str, tenant: str, cr_name: str, node: str, directory: str,
                         settings: Settings) -> dict[str, Any]:
    """A Job that deletes exactly `directory` (an encode Job's output) on `node`, for a node with no serving pod.

    Not owned by the UserMemory (it runs while that is being deleted; a foreground deletion would take it along):
    it removes itself after `ttlSecondsAfterFinished`. Bound to the node by `nodeName` (no scheduling: it also runs
    on a cordoned node), tolerating every taint for the second it takes.
    """
    container: dict[str, Any] = {
        "name": "cleanup",
        "image": settings.encoder_image,
        "command": ["rm", "-rf", "--", directory],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "kv", "mountPath": settings.kv_host_path}],
    }
    return _job(name, tenant, cr_name, {
        "backoffLimit": 2,
        "activeDeadlineSeconds": max(int(settings.cleanup_timeout_seconds), 1),
        "ttlSecondsAfterFinished": 600,
    }, {
        "nodeName": node,
        "tolerations": [{"operator": "Exists"}],
        "containers": [container],
        "volumes": [_kv_volume(settings)],
    })


def _kv_volume(settings: Settings) -> dict[str, Any]:
    return {"name": "kv", "hostPath": {"path": settings.kv_host_path, "type": "DirectoryOrCreate"}}


def _job(name: str, tenant: str, cr_name: str, job_spec: dict[str, Any], pod_spec: dict[str, Any]) -> dict[str, Any]:
    """A batch/v1 Job labelled for its UserMemory; its pods never restart in place (the Job retries)."""
    pod_labels = labels(tenant, cr_name)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": tenant, "labels": pod_labels},
        "spec": {**job_spec, "template": {"metadata": {"labels": pod_labels},
                                          "spec": {"restartPolicy": "Never", **pod_spec}}},
    }
