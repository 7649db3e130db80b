"""The per-user record: what the operator owns about a (tenant, userId), kept where tenants cannot write.

A ConfigMap in the platform namespace (`Settings.job_namespace`), named after the tenant and userId, holds the
UserMemory that claimed that userId (uid), and the nodes its encode Jobs ran on. It answers three questions that
the tenant-writable UserMemory status must not:
- which UserMemory owns a userId (a second object with the same userId in the tenant fails `DuplicateUserId` and
  never touches the first one's data);
- which userId an object was bound to (a changed `spec.userId` fails `UserIdImmutable`; purge uses the recorded id);
- on which nodes to delete Job output when the object goes (a forged `status.encoded[*].node` picks no node).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from . import jobs
from .kube import Kube
from .settings import LABEL_MANAGED_BY, LABEL_OWNER_UID, LABEL_ROLE, MANAGED_BY, Settings
from .spec import SpecError


@dataclasses.dataclass(frozen=True)
class UserRecord:
    name: str
    tenant: str
    user_id: str
    owner_uid: str
    owner_name: str
    nodes: tuple[str, ...]

    @classmethod
    def from_configmap(cls, cm: Mapping[str, Any]) -> UserRecord:
        data = cm.get("data") or {}
        try:
            nodes = tuple(str(n) for n in json.loads(data.get("nodes") or "[]"))
        except ValueError:
            nodes = ()
        return cls(name=cm["metadata"]["name"], tenant=str(data.get("tenant", "")), user_id=str(data.get("userId", "")),
                   owner_uid=str(data.get("ownerUid", "")), owner_name=str(data.get("ownerName", "")), nodes=nodes)


def record_name(tenant: str, user_id: str) -> str:
    return "inferscale-user-" + hashlib.sha256(f"{tenant}\0{user_id}".encode()).hexdigest()[:24]


def record_manifest(settings: Settings, tenant: str, user_id: str, cr_name: str, cr_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": record_name(tenant, user_id), "namespace": settings.job_namespace,
                     "labels": jobs.labels(tenant, cr_name, cr_uid, "user-record")},
        "data": {"tenant": tenant, "userId": user_id, "ownerUid": cr_uid, "ownerName": cr_name, "nodes": "[]"},
    }


def find_own(kube: Kube, settings: Settings, tenant: str, cr_uid: str) -> UserRecord | None:
    """The record this UserMemory claimed, if any (looked up by its uid, not by its current spec)."""
    found = kube.list_configmaps(settings.job_namespace, f"{LABEL_OWNER_UID}={cr_uid},{LABEL_ROLE}=user-record")
    for cm in found:
        if jobs.made_by_us(cm, settings, tenant, cr_uid, "user-record"):
            return UserRecord.from_configmap(cm)
    return None


def claim(kube: Kube, settings: Settings, tenant: str, user_id: str, cr_name: str, cr_uid: str) -> UserRecord:
    """This UserMemory's record for `user_id`, created on first use; SpecError when the id is not its to use."""
    own = find_own(kube, settings, tenant, cr_uid)
    if own is not None:
        if own.user_id != user_id:
            raise SpecError("UserIdImmutable", f"spec.userId was {own.user_id!r} and cannot change to {user_id!r}: "
                                               "create a new UserMemory for another user")
        return own
    manifest = record_manifest(settings, tenant, user_id, cr_name, cr_uid)
    kube.create_configmap(manifest)  # 409: someone holds it already; read who
    live = kube.read_configmap(settings.job_namespace, manifest["metadata"]["name"])
    rec = UserRecord.from_configmap(live) if live else None
    if rec is None or rec.owner_uid != cr_uid or rec.tenant != tenant or rec.user_id != user_id:
        holder = rec.owner_name if rec else "another object"
        raise SpecError("DuplicateUserId", f"userId {user_id!r} already belongs to UserMemory {tenant}/{holder}: "
                                           "one UserMemory per user")
    return rec


def add_node(kube: Kube, settings: Settings, record: UserRecord, node: str) -> UserRecord:
    if not node or node in record.nodes:
        return record
    nodes = tuple(sorted({*record.nodes, node}))
    kube.patch_configmap(settings.job_namespace, record.name, {"data": {"nodes": json.dumps(list(nodes))}})
    return dataclasses.replace(record, nodes=nodes)


def release(kube: Kube, settings: Settings, record: UserRecord) -> None:
    kube.delete_configmap(settings.job_namespace, record.name)


def list_all(kube: Kube, settings: Settings) -> list[UserRecord]:
    """Every per-user record the operator made, in every tenant (an orphan sweep walks them)."""
    found = kube.list_configmaps(settings.job_namespace, f"{LABEL_ROLE}=user-record,{LABEL_MANAGED_BY}={MANAGED_BY}")
    return [UserRecord.from_configmap(cm) for cm in found
            if (cm.get("metadata") or {}).get("namespace") == settings.job_namespace]
