"""UserMemory objects gone without their finalizer: purge their user from the operator's own record.

A tenant may remove the `inferscale.io/purge` finalizer (it may patch its objects); the object then disappears with
no purge, its blobs stay on the serving pods and nodes, and its record keeps the userId claimed, so no later object
could take it. The sweeper finds every record whose owner (by uid) no longer exists and runs the same purge the
finalizer would, from the record alone. It runs at start (deletions missed while the operator was down), on every
UserMemory DELETED event (at once), and every INFERSCALE_ORPHAN_SWEEP_SECONDS. Idempotent: a purge that is done
releases the record, so a second sweep finds nothing to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from . import purge, records
from .kube import Kube
from .settings import GROUP, VERSION, Settings

KIND = "UserMemory"


def _gone_body(record: records.UserRecord) -> dict[str, Any]:
    """What is known of the vanished object: enough to name it in Events and in cleanup Job names."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"namespace": record.tenant, "name": record.owner_name, "uid": record.owner_uid}}


class Sweeper:
    """Finds and purges orphaned records; `wake()` asks for a sweep now (a DELETED event)."""

    def __init__(self, cfg: Settings, kube: Kube, logger: logging.Logger) -> None:
        self.cfg, self.kube, self.logger = cfg, kube, logger
        self._wake = asyncio.Event()
        self._first_seen: dict[str, float] = {}  # record name -> when the sweeper first found it orphaned

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.sweep()
            except Exception as e:  # an API hiccup: the next sweep tries again
                self.logger.warning(f"orphan sweep failed: {e}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.cfg.orphan_sweep_seconds)

    async def sweep(self) -> int:
        """Purge every record whose UserMemory is gone; returns how many were released."""
        released = 0
        for record in await asyncio.to_thread(records.list_all, self.kube, self.cfg):
            if record.tenant not in self.cfg.tenants or await self._owner_exists(record):
                self._first_seen.pop(record.name, None)
                continue
            released += await self._purge(record)
        return released

    async def _owner_exists(self, record: records.UserRecord) -> bool:
        live = await asyncio.to_thread(self.kube.read_usermemory, record.tenant, record.owner_name)
        return live is not None and (live.get("metadata") or {}).get("uid") == record.owner_uid

    async def _purge(self, record: records.UserRecord) -> int:
        body = _gone_body(record)
        self.logger.warning(f"UserMemory {record.tenant}/{record.owner_name} is gone without its purge: "
                            f"purging user {record.user_id!r} from the operator's record")
        waiting = await purge.purge_record(self.cfg, self.kube, body, record)
        if not waiting:
            self._first_seen.pop(record.name, None)
            return 1
        first = self._first_seen.setdefault(record.name, time.time())
        if purge.past_deadline(self.cfg, first):
            await asyncio.to_thread(purge.give_up, self.cfg, self.kube, body, record, waiting)
            self._first_seen.pop(record.name, None)
            return 1
        return 0
