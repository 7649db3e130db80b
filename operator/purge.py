"""Deleting a UserMemory: purge its user from every serving pod, from the operator's record. Encode Jobs deliver their
blobs to a serving pod (jobs.Delivery) and keep nothing on a node, so the serving pods are the only place to purge.

Two ways in: the finalizer (`purge`, while the object still exists), and an object gone without its finalizer (a
tenant may remove it): `purge_record` works from the operator's record alone, so `orphans.py` can finish the job.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf

from . import records
from .kube import Kube
from .reconcile import tenant_allowed
from .servers import ServerCallError, ServerClient, serving_pods
from .settings import Settings
from .status import PURGED, set_condition

Body = Mapping[str, Any]
_log = logging.getLogger(__name__)


def _event(body: Body, warning: bool, reason: str, message: str) -> None:
    """An Event on the object, or a log line where Kopf cannot post one (the orphan sweeper runs outside a handler,
    for an object that is gone)."""
    try:
        (kopf.warn if warning else kopf.info)(body, reason=reason, message=message)
    except LookupError:
        _log.log(logging.WARNING if warning else logging.INFO, f"{reason}: {message}")


async def purge(cfg: Settings, kube: Kube, body: Body, patch: kopf.Patch, logger: logging.Logger) -> None:
    """The finalizer: purge the user from every serving pod. Raise (retry) until all of them answered.

    The user comes from the operator's record (records.py), never from the tenant-writable spec/status:
    an object that never claimed a userId (invalid, duplicate, not a tenant) placed nothing and is released at once.
    Past INFERSCALE_PURGE_TIMEOUT_SECONDS after the deletion began, it gives up with a Warning and releases the
    finalizer: a purge that cannot succeed must not block the namespace's deletion forever."""
    meta = body["metadata"]
    tenant, uid = meta["namespace"], str(meta.get("uid") or "")
    record = await asyncio.to_thread(records.find_own, kube, cfg, tenant, uid) if tenant_allowed(cfg, tenant) else None
    if record is None:
        return
    waiting = await purge_record(cfg, kube, body, record)
    if not waiting:
        return
    if past_deadline(cfg, _parse_time(meta.get("deletionTimestamp"))):
        msg = give_up(cfg, kube, body, record, waiting)
        conds = set_condition(list((body.get("status") or {}).get("conditions") or []), PURGED, False,
                              "PurgeTimedOut", msg, meta.get("generation"))
        patch.status.update(phase="Deleting", message=msg, conditions=conds)
        return
    patch.status.update(phase="Deleting", message=f"waiting for {waiting}")
    raise kopf.TemporaryError(waiting, delay=cfg.job_poll_seconds)


async def purge_record(cfg: Settings, kube: Kube, body: Body, record: records.UserRecord) -> str:
    """One purge round for the user of `record`; the record is released when it is done. "" when done, else what
    it still waits for. `body` names the object for Events and cleanup Job names (it may be gone already)."""
    try:
        waiting = await _purge_once(cfg, kube, body, record.user_id)
    except ServerCallError as e:
        waiting = str(e)
    if not waiting:
        await asyncio.to_thread(records.release, kube, cfg, record)
    return waiting


def past_deadline(cfg: Settings, started: float | None) -> bool:
    return started is not None and time.time() - started > cfg.purge_timeout_seconds


def give_up(cfg: Settings, kube: Kube, body: Body, record: records.UserRecord, waiting: str) -> str:
    """Release the record of a purge that ran past INFERSCALE_PURGE_TIMEOUT_SECONDS, with a Warning; its message."""
    msg = (f"purge gave up after {cfg.purge_timeout_seconds:.0f}s ({waiting}); {record.tenant}/{record.user_id} may "
           "be left on serving pods")
    _event(body, True, reason="PurgeTimedOut", message=msg)
    records.release(kube, cfg, record)
    return msg


async def _purge_once(cfg: Settings, kube: Kube, body: Body, user: str) -> str:
    """One purge round: "" when done, else what it still waits for."""
    tenant = body["metadata"]["namespace"]
    raw = await asyncio.to_thread(kube.list_pods, cfg.server_namespace, cfg.server_selector)
    pods = serving_pods(raw, cfg.internal_port, require_ready=False, nixl_port=cfg.nixl_port,
                        scheme=cfg.internal_scheme)
    async with ServerClient(cfg) as client:
        results = await asyncio.gather(*(client.purge(p, tenant, user, None) for p in pods), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        return f"purge failed on {len(failed)}/{len(pods)} serving pod(s): {failed[0]}"
    removed = sum(int(r.get("removed_blocks") or 0) for r in results if isinstance(r, dict))
    _event(body, False, reason="Purged", message=f"removed {removed} block(s) from {len(pods)} serving pod(s)")
    return ""


def _parse_time(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
