"""Encoding and cleanup Jobs: the manifests (pure functions), how to read a Job's outcome, and whose Job it is.

Trust boundary (ARCHITECTURE.md, "Trust boundary"): every Job, its items ConfigMap and the per-user record live in
the Jobs' namespace (`Settings.job_namespace`), which tenants cannot write to. An encode Job mounts no hostPath: it
writes its blobs to its own emptyDir, then delivers them to the serving pod the operator chose (`Delivery`:
`POST /internal/v1/ingest/<tenant>/<user>` with an upload credential minted for that tenant, user and Job,
inferscale/uploadtoken.py). It runs as the image's non-root user under Pod Security `restricted` and is bounded in
time and resources. The operator trusts a Job only when it carries the labels it set for that
UserMemory's uid, and a pod only when the Job is its controller (ownerReferences), never by a `job-name` label.

A Job's name derives from the tenant, the UserMemory's uid, the content hash and the ids it encodes, so a restarted
operator derives the same name and a create answered 409 means "already there".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from inferscale.contract import DEFAULT_KV_DTYPE

from .names import label_value
from .settings import (APP_NAME, LABEL_COMPONENT, LABEL_MANAGED_BY, LABEL_NAME, LABEL_OWNER_UID, LABEL_PART_OF,
                       LABEL_ROLE, LABEL_TENANT, LABEL_USERMEMORY, MANAGED_BY, Settings)
from .spec import Item

ITEMS_MOUNT = "/memories"
ITEMS_KEY = "items.jsonl"
# The encode Job's own emptyDir: its blobs, before it delivers them.
OUT_MOUNT = "/var/run/inferscale/out"
KEK_MOUNT = "/var/run/inferscale/kek"
KEK_KEY = "kek"
# The Job's upload credential (inferscale/uploadtoken.py): a key of its own Secret, or (Jobs in the release
# namespace, where the operator may create no Secret) its pod's annotation through the downward API.
CREDENTIAL_MOUNT = "/var/run/inferscale/upload"
CREDENTIAL_KEY = "upload-credential"
ANNOTATION_CREDENTIAL = "inferscale.io/upload-credential"
# The fleet CA's certificate (public), for a delivery over TLS: the pod's annotation, a file through the downward API.
FLEET_CA_MOUNT = "/var/run/inferscale/fleet-ca"
FLEET_CA_KEY = "ca.crt"
ANNOTATION_FLEET_CA = "inferscale.io/fleet-ca"
# Where the Job delivers (the pod the operator chose, and its node): read back when the Job has succeeded.
ANNOTATION_DELIVER_POD = "inferscale.io/deliver-pod"
ANNOTATION_DELIVER_NODE = "inferscale.io/deliver-node"
HOSTNAME_LABEL = "kubernetes.io/hostname"
# The API server's limit on a ConfigMap's data (keys and values together).
CONFIGMAP_MAX_BYTES = 1 << 20
# How many items an encode Job encodes: the per-tenant cap on pending encode work counts these (quota.py).
ANNOTATION_ITEMS = "inferscale.io/items"
# The credential outlives the Job's deadline by this much (a pod may wait to be scheduled).
CREDENTIAL_MARGIN_S = 600

JobPhase = Literal["Running", "Succeeded", "Failed"]
Role = Literal["encode", "items", "key", "user-record"]


@dataclasses.dataclass(frozen=True)
class Delivery:
    """Where an encode Job delivers its blobs: a serving pod's ingest URL, that pod and its node, and (an https URL)
    the fleet CA's certificate and the server name the pod proves (inferscale/fleettls.py)."""
    url: str
    pod: str  # namespace/name
    node: str
    ca_pem: str = ""  # public: handed to the Job as its pod's annotation
    server_name: str = ""


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:10]


def _prefix(tenant: str, cr_name: str) -> str:
    # Job names end up in the `job-name` label of its pods: 63 characters at most.
    return f"{tenant}-{cr_name}"[:40].rstrip("-.")


def job_name(tenant: str, cr_name: str, cr_uid: str, content_hash: str, ids: Iterable[str]) -> str:
    # Tenant and uid in the hash: Jobs of every tenant share one namespace, and a later namesake UserMemory must
    # not find this one's Job.
    return f"{_prefix(tenant, cr_name)}-enc-{_digest(tenant, cr_uid, content_hash, sorted(ids))}"


def labels(tenant: str, cr_name: str, cr_uid: str, role: Role) -> dict[str, str]:
    # The standard app.kubernetes.io labels (component = the object's role) beside the operator's own.
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_NAME: APP_NAME, LABEL_COMPONENT: role, LABEL_PART_OF: APP_NAME,
            LABEL_TENANT: tenant, LABEL_USERMEMORY: label_value(cr_name), LABEL_OWNER_UID: cr_uid, LABEL_ROLE: role}


def made_by_us(obj: Mapping[str, Any] | None, settings: Settings, tenant: str, cr_uid: str, role: Role) -> bool:
    """Whether `obj` is one the operator created for this UserMemory: in the platform namespace, with its labels."""
    if not obj:
        return False
    meta = obj.get("metadata") or {}
    lab = meta.get("labels") or {}
    return (meta.get("namespace") == settings.job_namespace and lab.get(LABEL_MANAGED_BY) == MANAGED_BY
            and lab.get(LABEL_TENANT) == tenant and lab.get(LABEL_OWNER_UID) == cr_uid and lab.get(LABEL_ROLE) == role)


def pods_of(job: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods whose controller is this Job (by uid), in the Job's namespace: a `job-name` label proves nothing."""
    meta = job.get("metadata") or {}
    uid, ns = meta.get("uid"), meta.get("namespace")
    if not uid:
        return []
    return [p for p in pods if (p.get("metadata") or {}).get("namespace") == ns
            and any(o.get("controller") and o.get("kind") == "Job" and o.get("uid") == uid
                    for o in (p.get("metadata") or {}).get("ownerReferences") or [])]


def configmap_manifest(name: str, settings: Settings, tenant: str, cr_name: str, cr_uid: str,
                       items: Iterable[Item]) -> dict[str, Any]:
    """The Job's items file. Created before the Job (a file too large for a ConfigMap fails before any GPU is held),
    then owned by it (`owner_reference`: garbage-collected with it; a UserMemory cannot own across namespaces)."""
    jsonl = "".join(json.dumps(item.as_json(), ensure_ascii=False) + "\n" for item in items)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": settings.job_namespace,
                     "labels": labels(tenant, cr_name, cr_uid, "items")},
        "data": {ITEMS_KEY: jsonl},
    }


def key_secret_manifest(name: str, settings: Settings, tenant: str, cr_name: str, cr_uid: str,
                        tenant_keys: str, credential: str) -> dict[str, Any]:
    """The Job's Secret: its key file (inferscale/tenantkey.py: its tenant's derived keys) and its upload credential,
    created before it, then owned by it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "namespace": settings.job_namespace,
                     "labels": labels(tenant, cr_name, cr_uid, "key")},
        "stringData": {KEK_KEY: tenant_keys, CREDENTIAL_KEY: credential},
    }


def configmap_bytes(cm: Mapping[str, Any]) -> int:
    """What the API server counts against a ConfigMap's size limit: its data, keys and values, in bytes."""
    return sum(len(k.encode()) + len(str(v).encode()) for k, v in (cm.get("data") or {}).items())


def owner_reference(owner_job: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch making the Job the owner of its items ConfigMap (and key Secret)."""
    jmeta = owner_job.get("metadata") or {}
    return {"metadata": {"ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": jmeta.get("name", ""),
                                              "uid": jmeta.get("uid", ""), "blockOwnerDeletion": False}]}}


def restricted_container_context() -> dict[str, Any]:
    """Pod Security Standard `restricted`, per container."""
    return {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def _pod_context(settings: Settings) -> dict[str, Any]:
    uid = settings.run_as_user
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _credential_volume(name: str, settings: Settings) -> dict[str, Any]:
    if settings.kek_file:  # the Job's own Secret holds it (key_secret_manifest)
        return {"name": "upload", "secret": {"secretName": name, "defaultMode": 0o440,
                                             "items": [{"key": CREDENTIAL_KEY, "path": CREDENTIAL_KEY}]}}
    # Jobs beside the platform's Secrets: the operator may create none there, so the pod's own annotation.
    return {"name": "upload", "downwardAPI": {"defaultMode": 0o440, "items": [
        {"path": CREDENTIAL_KEY, "fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION_CREDENTIAL}']"}}]}}


def job_manifest(name: str, tenant: str, cr_name: str, cr_uid: str, user_id: str, model: str,
                 ids: Iterable[str], settings: Settings, delivery: Delivery, credential: str) -> dict[str, Any]:
    """The encode Job: encode `ids` into its emptyDir, then deliver them to `delivery` with `credential`."""
    ids = sorted(ids)
    command = ["inferscale", "encode", f"{ITEMS_MOUNT}/{ITEMS_KEY}", "--out", OUT_MOUNT, "--model", model,
               "--only", ",".join(sorted(ids)), "--embed",
               "--deliver", delivery.url, "--upload-credential-file", f"{CREDENTIAL_MOUNT}/{CREDENTIAL_KEY}"]
    volumes: list[dict[str, Any]] = [{"name": "memories", "configMap": {"name": name}},
                                     {"name": "out", "emptyDir": {"sizeLimit": settings.encoder_out_size}},
                                     {"name": "tmp", "emptyDir": {"sizeLimit": settings.encoder_out_size}},
                                     _credential_volume(name, settings)]
    mounts: list[dict[str, Any]] = [{"name": "memories", "mountPath": ITEMS_MOUNT, "readOnly": True},
                                    {"name": "out", "mountPath": OUT_MOUNT},
                                    {"name": "tmp", "mountPath": "/tmp"},
                                    {"name": "upload", "mountPath": CREDENTIAL_MOUNT, "readOnly": True}]
    pod_annotations = {} if settings.kek_file else {ANNOTATION_CREDENTIAL: credential}
    if delivery.ca_pem:  # an https delivery: the Job checks the pod's certificate as the operator does
        command += ["--tls-ca-file", f"{FLEET_CA_MOUNT}/{FLEET_CA_KEY}", "--tls-server-name", delivery.server_name]
        pod_annotations[ANNOTATION_FLEET_CA] = delivery.ca_pem
        volumes.append({"name": "fleet-ca", "downwardAPI": {"defaultMode": 0o444, "items": [
            {"path": FLEET_CA_KEY, "fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION_FLEET_CA}']"}}]}})
        mounts.append({"name": "fleet-ca", "mountPath": FLEET_CA_MOUNT, "readOnly": True})
    key_secret = name if settings.kek_file else settings.kek_secret
    if key_secret:
        # Blobs are sealed with a data key wrapped for this tenant and bound to it and the user; with kek_file the
        # Job's own Secret (key_secret_manifest) holds only this tenant's derived keys, never the KEK.
        command += ["--kek-file", f"{KEK_MOUNT}/{KEK_KEY}", "--tenant", tenant, "--user", user_id]
        volumes.append({"name": "kek", "secret": {"secretName": key_secret, "defaultMode": 0o440,
                                                  "items": [{"key": KEK_KEY, "path": KEK_KEY}]}})
        mounts.append({"name": "kek", "mountPath": KEK_MOUNT, "readOnly": True})
    if settings.kv_dtype != DEFAULT_KV_DTYPE:
        command += ["--kv-dtype", settings.kv_dtype]
    resources = json.loads(json.dumps(dict(settings.encoder_resources)))
    if settings.encoder_gpus > 0:
        resources.setdefault("limits", {})["nvidia.com/gpu"] = str(settings.encoder_gpus)  # a quantity: a string
    container: dict[str, Any] = {
        "name": "encode",
        "image": settings.encoder_image,
        "command": command,
        "env": [{"name": "INFERSCALE_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "HOME", "value": "/tmp"}],
        "resources": resources,
        "securityContext": restricted_container_context(),
        "volumeMounts": mounts,
    }
    where = {ANNOTATION_DELIVER_POD: delivery.pod, ANNOTATION_DELIVER_NODE: delivery.node}
    return _job(name, tenant, cr_name, cr_uid, "encode", settings, {
        # A bad item exits 2 and would fail again: retrying only burns GPU time.
        "backoffLimit": 1,
        "activeDeadlineSeconds": int(settings.encode_deadline_seconds),
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": "encode", "operator": "In", "values": [2]}},
        ]},
        "ttlSecondsAfterFinished": 86400,
    }, {
        "nodeSelector": dict(settings.encoder_node_selector),
        "tolerations": [dict(t) for t in settings.encoder_tolerations],
        "containers": [container],
        "volumes": volumes,
    }, {ANNOTATION_ITEMS: str(len(ids)), **where}, pod_annotations or None)


def delivered_to(job: Mapping[str, Any]) -> tuple[str, str]:
    """(pod as namespace/name, node) a succeeded encode Job delivered to (its annotations, set by the operator)."""
    ann = (job.get("metadata") or {}).get("annotations") or {}
    return str(ann.get(ANNOTATION_DELIVER_POD) or ""), str(ann.get(ANNOTATION_DELIVER_NODE) or "")


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


def _job(name: str, tenant: str, cr_name: str, cr_uid: str, role: Role, settings: Settings,
         job_spec: dict[str, Any], pod_spec: dict[str, Any],
         annotations: dict[str, str] | None = None, pod_annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A batch/v1 Job in the Jobs' namespace, labelled for its UserMemory; its pods never restart in place."""
    pod_labels = labels(tenant, cr_name, cr_uid, role)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": settings.job_namespace, "labels": pod_labels,
                     "annotations": annotations or {}},
        "spec": {**job_spec, "template": {"metadata": {"labels": pod_labels, "annotations": pod_annotations or {}},
                                          "spec": {
            "restartPolicy": "Never", "automountServiceAccountToken": False, "enableServiceLinks": False,
            "securityContext": _pod_context(settings), **pod_spec}}},
    }
