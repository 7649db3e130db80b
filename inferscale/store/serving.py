"""Serving peers (G4, the owner's side): answer "where are blocks X, Y of tenant/user?" with arena addresses,
hold those blocks under a lease while the puller READs them through NIXL, and end the lease on the NIXL
completion notification (or a timer, if the puller vanished)."""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferscale.errors import NotFoundError
from inferscale.store.layout import check_fingerprint, check_name
from inferscale.store.peer import PeerServer
from inferscale.store.tiers import DramEntry

if TYPE_CHECKING:
    from inferscale.store.store import KVStore

log = logging.getLogger(__name__)
LEASE_SECONDS = 30.0


class PeerService:
    def __init__(self, store: KVStore, host: str, port: int, *, token: str | None, timeout_s: float) -> None:
        self.store = store
        self.leases: dict[str, tuple[list[DramEntry], threading.Timer]] = {}
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.closing = False
        self.watcher: threading.Thread | None = None
        self.server = PeerServer(host, port, self.handle, token=token, timeout_s=timeout_s)
        self.port = self.server.port

    def close(self) -> None:
        self.server.close()
        self.closing = True
        if self.watcher is not None:
            with self.cv:
                self.cv.notify_all()
            self.watcher.join(5)
        with self.lock:
            for lease in list(self.leases):
                self._end_lease(lease)

    # -- serving peers --------------------------------------------------------------------------------------
    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "ping":
            return {"node": self.store.node}
        if op == "release":
            with self.lock:
                self._end_lease(str(msg.get("lease")))
            return {"ok": True}
        if op != "locate":
            return {"error": "bad_request", "message": f"unknown op {op!r}"}
        if self.store.transport is None or not self.store.transport.has_ucx:
            return {"error": "unavailable", "message": "this node has no NIXL UCX agent"}
        tenant, user = check_name("tenant", msg.get("tenant")), check_name("user", msg.get("user"))
        items, fp, src = msg.get("items"), msg.get("fingerprint"), msg.get("dir")
        for i in items or []:
            check_name("item", i)
        if fp is not None:
            check_fingerprint(fp)
        if src:
            self._import_for_peer(tenant, user, Path(src), items)
        rows = self.store.catalogue.items(tenant, user, fp, items)
        if not rows:
            raise NotFoundError(f"no memories for tenant {tenant!r} user {user!r} on node {self.store.node}")
        missing = set(items or []) - {r.item_id for r in rows}
        if missing:
            raise NotFoundError(f"items {sorted(missing)} not found for tenant {tenant!r} user {user!r} on node "
                                f"{self.store.node}")
        rows = [r for r in rows if not r.corrupt]
        entries, loaded, evicted = self.store._ensure_dram(tenant, rows, {r.key for r in rows})
        self.store.catalogue.record([], {("dram", 0): evicted, ("dram", 1): [e.key for e in loaded]})
        held = [entries[r.key] for r in rows]
        lease = uuid.uuid4().hex
        timer = threading.Timer(LEASE_SECONDS, self._expire_lease, args=(lease,))
        timer.daemon = True
        with self.cv:
            self.leases[lease] = (held, timer)
            if self.watcher is None:
                self.watcher = threading.Thread(target=self._watch_leases, name="kvstore-leases", daemon=True)
                self.watcher.start()
            self.cv.notify_all()
        timer.start()
        return {
            "lease": lease, "node": self.store.node,
            "agent": base64.b64encode(self.store.transport.metadata()).decode(),
            "blocks": [{"item": e.key[3], "fingerprint": e.key[2], "addr": self.store.arena.base + e.offset,
                        "size": e.size, "sha256": e.info.sha256} for e in held],
        }

    def _import_for_peer(self, tenant: str, user: str, src: Path, items: list[str] | None) -> None:
        """Import a Job's output directory named by a puller, only if it is this tenant/user's directory."""
        if not src.is_absolute() or ".." in src.parts or src.parts[-2:] != (tenant, user):
            raise NotFoundError(f"directory {src} is not a blob directory of tenant {tenant!r} user {user!r}")
        have = {r.item_id for r in self.store.catalogue.items(tenant, user)}
        missing = None if items is None else [i for i in items if i not in have]
        if missing == [] or not src.is_dir():
            return
        self.store.import_dir(tenant, user, src, missing)

    def _watch_leases(self) -> None:
        """While leases are out, progress the NIXL agent (peers' READs over transports that need the target to
        progress, e.g. TCP) and end each lease when its puller's completion notification arrives."""
        while not self.closing:
            with self.cv:
                if not self.leases:
                    self.cv.wait(timeout=1.0)
                    continue
            try:
                msgs = self.store.transport.poll_notifs()
            except Exception as e:  # noqa: BLE001 - keep serving; leases still expire on their timers
                log.warning("polling NIXL notifications: %s", e)
                msgs = []
            for m in msgs:
                if m.startswith(b"lease:"):
                    with self.lock:
                        self._end_lease(m[6:].decode(errors="replace"))
            time.sleep(0.0002)

    def _expire_lease(self, lease: str) -> None:
        with self.lock:
            self._end_lease(lease)

    def _end_lease(self, lease: str) -> None:
        held = self.leases.pop(lease, None)
        if held is not None:
            held[1].cancel()
            for e in held[0]:
                self.store.dram.release(e)
