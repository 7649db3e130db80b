"""Per-tenant bounds on encode Jobs: how many run at once, and how many items they encode together.

Encode Jobs run outside the tenant's namespace, so its ResourceQuota never applies to them; without a bound, 200
UserMemory objects made 200 Jobs, each asking a GPU. A UserMemory whose Job would pass its tenant's bound waits
(status Pending, condition Encoded=False reason EncodeQueued) and is retried; nothing is created for it meanwhile.
A single Job larger than the item bound still starts when its tenant has no other Job running (else it never could).

The check and the create are one step under a per-tenant lock: handlers of one tenant's objects run concurrently
(each in a thread, `asyncio.to_thread`), and two of them must not both see room for one more Job.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from . import jobs
from .kube import Kube
from .settings import LABEL_MANAGED_BY, LABEL_ROLE, LABEL_TENANT, MANAGED_BY, Settings

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _tenant_lock(tenant: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(tenant, threading.Lock())


def running_encodes(kube: Kube, cfg: Settings, tenant: str) -> list[Mapping[str, Any]]:
    """The tenant's encode Jobs (made by the operator) that have not finished."""
    selector = f"{LABEL_TENANT}={tenant},{LABEL_ROLE}=encode,{LABEL_MANAGED_BY}={MANAGED_BY}"
    return [j for j in kube.list_jobs(cfg.job_namespace, selector) if jobs.job_phase(j)[0] == "Running"]


def _items(job: Mapping[str, Any]) -> int:
    try:
        return int(((job.get("metadata") or {}).get("annotations") or {}).get(jobs.ANNOTATION_ITEMS) or 0)
    except ValueError:
        return 0


def why_wait(cfg: Settings, running: list[Mapping[str, Any]], items: int) -> str:
    """"" when a Job of `items` items may start beside `running`, else why it waits."""
    if len(running) >= cfg.max_encode_jobs_per_tenant:
        return (f"{len(running)} encode Job(s) of this tenant are running (INFERSCALE_MAX_ENCODE_JOBS_PER_TENANT="
                f"{cfg.max_encode_jobs_per_tenant})")
    pending = sum(_items(j) for j in running)
    if running and pending + items > cfg.max_encode_items_per_tenant:
        return (f"this tenant's running encode Jobs hold {pending} item(s); {items} more would pass "
                f"INFERSCALE_MAX_ENCODE_ITEMS_PER_TENANT={cfg.max_encode_items_per_tenant}")
    return ""


def start_encode(kube: Kube, cfg: Settings, tenant: str, items_cm: dict[str, Any], job: dict[str, Any],
                 key_secret: dict[str, Any] | None = None) -> str:
    """Create the items ConfigMap (and the Job's key Secret), then the Job, if the tenant has room: "" when created
    (or already there), else why it waits. The ConfigMap goes first: one too large for the API fails here, before
    any Job holds a GPU."""
    with _tenant_lock(tenant):
        why = why_wait(cfg, running_encodes(kube, cfg, tenant), _items(job))
        if why:
            return why
        kube.create_configmap(items_cm)  # 409: a crash after this; same content-derived name, same content
        if key_secret is not None:
            kube.create_secret(key_secret)
        kube.create_job(job)
    return ""
