"""Serving peers (G4, the owner's side): answer "where are blocks X, Y of tenant/user?" with a lease: a staging
copy of exactly those blocks, registered with NIXL UCX for that lease alone (nixl_transport.Lease), whose
addresses and partial agent metadata are all the puller gets. The lease ends on the puller's NIXL completion
notification, its "release", or a timer (if the puller vanished); then its bytes are zeroed and deregistered."""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferscale.errors import NotFoundError
from inferscale.jobpaths import job_dir_path
from inferscale.store.layout import check_fingerprint, check_name
from inferscale.store.peer import PeerServer

if TYPE_CHECKING:
    from inferscale.store.nixl_transport import Lease
    from inferscale.store.store import KVStore

log = logging.getLogger(__name__)
LEASE_SECONDS = 30.0


def partial_marker(root: str | Path, tenant: str, user: str) -> Path:
    """Present while this node holds only some of the user's blocks (fetched on demand, server/fleet.py): its
    index is then not the user's whole list, so it is never served as one."""
    return Path(root) / ".fleet-partial" / tenant / user


class PeerService:
    def __init__(self, store: KVStore, host: str, port: int, *, secret: str | None, timeout_s: float) -> None:
        self.store = store
        self.leases: dict[str, tuple[Lease, threading.Timer]] = {}
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.closing = False
        self.watcher: threading.Thread | None = None
        self.server = PeerServer(host, port, self.handle, secret=secret, timeout_s=timeout_s)
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
        if op == "index":
            return self._index(msg)
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
            self._import_for_peer(tenant, user, str(src), items)
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
        try:  # the lease is a copy: the arena slots go back at once and are never exposed to a peer
            region = self.store.transport.open_lease([self.store.arena.view(e.offset, e.size) for e in held])
        finally:
            for e in held:
                self.store.dram.release(e)
        lease = uuid.uuid4().hex
        timer = threading.Timer(LEASE_SECONDS, self._expire_lease, args=(lease,))
        timer.daemon = True
        with self.cv:
            self.leases[lease] = (region, timer)
            if self.watcher is None:
                self.watcher = threading.Thread(target=self._watch_leases, name="kvstore-leases", daemon=True)
                self.watcher.start()
            self.cv.notify_all()
        timer.start()
        return {
            "lease": lease, "node": self.store.node, "agent": base64.b64encode(region.metadata).decode(),
            "blocks": [{"item": e.key[3], "fingerprint": e.key[2], "addr": addr, "size": size,
                        "sha256": e.info.sha256} for e, (addr, size) in zip(held, region.ranges)],
        }

    def _index(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The user's retrieval index on this node: item ids and their embeddings (float32, base64), so a puller
        can pick the top-k itself and then lease exactly those blocks. With ``job_dir: true``, the Job's output
        on this node (``<job_root>/<tenant>/<user>``, read by the same rule as ``locate``'s dir) is imported first."""
        tenant, user = check_name("tenant", msg.get("tenant")), check_name("user", msg.get("user"))
        fp = check_fingerprint(msg.get("fingerprint"))
        if msg.get("job_dir") is True and self.store.job_root is not None:  # this node's own Job dir: no path
            own = self.store.job_root / tenant / user                          # travels on the wire
            if own.is_dir():
                self._import_for_peer(tenant, user, str(own), None)
        if partial_marker(self.store.root, tenant, user).exists():
            raise NotFoundError(f"node {self.store.node} holds only part of user {user!r} of tenant {tenant!r}")
        ids, matrix = self.store.embeddings(tenant, user, fp)  # NotFoundError -> {"error": "not_found"}
        m = matrix.contiguous().to("cpu")
        return {"node": self.store.node, "items": ids, "dim": int(m.shape[1]) if ids else 0,
                "embeddings": base64.b64encode(m.numpy().tobytes()).decode() if ids else ""}

    def _import_for_peer(self, tenant: str, user: str, src: str, items: list[str] | None) -> None:
        """Import a Job's output directory named by a puller: only ``<job_root>/<tenant>/<user>`` of this node
        (the one rule of inferscale/jobpaths.py), read without following symlinks."""
        path = job_dir_path(self.store.job_root, tenant, user, src, param="dir")
        have = {r.item_id for r in self.store.catalogue.items(tenant, user)}
        missing = None if items is None else [i for i in items if i not in have]
        if missing == [] or not path.is_dir():
            return
        self.store.import_dir(tenant, user, path, missing)

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
            self.store.transport.close_lease(held[0])
