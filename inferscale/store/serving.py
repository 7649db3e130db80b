"""Serving peers (G4, the owner's side, the lessor): answer "where are blocks X, Y of tenant/user?" (op
``locate``) with a lease: those blocks held DRAM-resident for this session (inferscale/store/leases.py), their
sizes and checksums, and nothing that names this node's memory. On op ``write`` the owner's NIXL agent WRITEs
exactly the leased blocks into the destination slots the puller exposed, then the lease ends; it also ends on
``release`` or when the session does. Op ``pull`` is both in one request, for a puller that knows the blocks'
sizes from this node's index (``index`` gives them) and exposed its slots first: one round trip."""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferscale.errors import NotFoundError, TransferError
from inferscale.jobpaths import job_dir_path
from inferscale.store.layout import check_fingerprint, check_name, request_keys
from inferscale.store.leases import Lease, LeaseBook, LeaseCaps
from inferscale.store.peer import PeerServer, Session

if TYPE_CHECKING:
    from inferscale.fleettls import FleetTls
    from inferscale.store.node import StoreNode
    from inferscale.store.tiers import DramEntry

log = logging.getLogger(__name__)


def partial_marker(root: str | Path, tenant: str, user: str) -> Path:
    """Present while this node holds only some of the user's blocks (fetched on demand, inferscale/store/fleet.py): its
    index is then not the user's whole list, so it is never served as one."""
    return Path(root) / ".fleet-partial" / tenant / user


class PeerService:
    def __init__(self, store: StoreNode, host: str, port: int, *, secret: str, timeout_s: float,
                 caps: LeaseCaps | None = None, tls: FleetTls | None = None) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.leases = LeaseBook(caps or LeaseCaps.for_arena(store.arena.size), store.dram.release)
        self.server = PeerServer(host, port, self.handle, secret, timeout_s, on_close=self._session_closed,
                                 tls=tls)
        self.port = self.server.port

    def close(self) -> None:
        self.server.close()
        self.leases.end_all()

    def _session_closed(self, session: Session) -> None:
        self.leases.end_session(session.id)

    # -- serving peers --------------------------------------------------------------------------------------
    def handle(self, msg: dict[str, Any], session: Session) -> dict[str, Any]:
        op = msg.get("op")
        if op == "ping":
            return {"node": self.store.node}
        if op == "release":
            lease = self.leases.take(msg.get("lease"), session.id)
            if lease is not None:
                self.leases.end(lease)
            return {"ok": True}
        if op == "index":
            return self._index(msg)
        if op not in ("locate", "write", "pull"):
            return {"error": "bad_request", "message": f"unknown op {op!r}"}
        if self.store.transport is None or not self.store.transport.has_ucx:
            return {"error": "unavailable", "message": "this node has no NIXL UCX agent"}
        if op == "write":
            return self._write(msg, session)
        if op == "pull":
            return self._pull(msg, session)
        tenant, user = check_name("tenant", msg.get("tenant")), check_name("user", msg.get("user"))
        items, fp, src = msg.get("items"), msg.get("fingerprint"), msg.get("dir")
        for i in items or []:
            check_name("item", i)
        if fp is not None:
            check_fingerprint(fp)
        if src:
            self._import_for_peer(tenant, user, str(src), items)
        held = self._resident(tenant, user, fp, items)
        if held is None:
            held = self._loaded(tenant, user, fp, items)
        lease = self.leases.open(session.id, session.peer, tenant, held)  # the references pass to the lease
        return {"lease": lease.id, "node": self.store.node,
                "blocks": [{"item": e.key[3], "fingerprint": e.key[2], "size": e.size, "sha256": e.info.sha256}
                           for e in held]}

    def _resident(self, tenant: str, user: str, fp: str | None, items: list[str] | None) -> list[DramEntry] | None:
        """The named blocks' DRAM entries (a reference each) when all are resident: a serving node's usual case,
        answered without the catalogue (a resident entry is its key's current, verified version: KVStore.get_many)."""
        if fp is None or not items:
            return None
        return self.store.dram.acquire_all(request_keys(tenant, user, fp, items))

    def _loaded(self, tenant: str, user: str, fp: str | None, items: list[str] | None) -> list[DramEntry]:
        """The blocks' DRAM entries (a reference each), by the catalogue, loading those not resident from disk."""
        rows = self.store.catalogue.items(tenant, user, fp, items)
        if not rows:
            raise NotFoundError(f"no memories for tenant {tenant!r} user {user!r} on node {self.store.node}")
        missing = set(items or []) - {r.item_id for r in rows}
        if missing:
            raise NotFoundError(f"items {sorted(missing)} not found for tenant {tenant!r} user {user!r} on node "
                                f"{self.store.node}")
        rows = [r for r in rows if not r.corrupt]
        entries, _, _ = self.store.ensure_dram(tenant, rows, {r.key for r in rows})
        return [entries[r.key] for r in rows]

    def _write(self, msg: dict[str, Any], session: Session) -> dict[str, Any]:
        """WRITE the lease's blocks into the puller's exposed slots, then end the lease."""
        lease = self.leases.take(msg.get("lease"), session.id)
        if lease is None:
            return {"error": "bad_request", "message": "no such lease in this session (ended or expired)"}
        return self._write_lease(lease, msg)

    def _pull(self, msg: dict[str, Any], session: Session) -> dict[str, Any]:
        """``locate`` and ``write`` in one request, for a puller that knows the blocks' sizes (from this node's
        index) and exposed its slots first: the blocks leased, checked to be those sizes (else ``changed``,
        nothing written: the puller leases them afresh), written, the lease ended."""
        tenant, user = check_name("tenant", msg.get("tenant")), check_name("user", msg.get("user"))
        items, fp, sizes = msg.get("items"), check_fingerprint(msg.get("fingerprint")), msg.get("sizes")
        if (not isinstance(items, list) or not items or not isinstance(sizes, list) or len(sizes) != len(items)
                or any(not isinstance(n, int) for n in sizes)):
            return {"error": "bad_request", "message": "pull needs items and one size per item"}
        held = self._resident(tenant, user, fp, items)  # request_keys checks every item's name
        if held is None:
            held = self._loaded(tenant, user, fp, items)
        if [e.size for e in held] != sizes:
            for e in held:
                self.store.dram.release(e)
            return {"error": "changed", "message": f"the blocks of {tenant}/{user} changed since the index"}
        lease = self.leases.open(session.id, session.peer, tenant, held)
        reply = self._write_lease(lease, msg)
        if "error" not in reply:  # the puller knows the items and sizes: their checksums are what it lacks
            reply["sha256"] = [e.info.sha256 for e in held]
        return reply

    def _write_lease(self, lease: Lease, msg: dict[str, Any]) -> dict[str, Any]:
        """WRITE ``lease``'s blocks into the puller's exposed slots ``dsts`` [[address, size], ...] (one per
        block, each exactly the block's size) of its agent ``agent``, then end the lease."""
        try:
            dsts, agent = msg.get("dsts"), msg.get("agent")
            sizes = [e.size for e in lease.entries]
            if (not isinstance(agent, str) or not isinstance(dsts, list) or len(dsts) != len(sizes)
                    or any(not (isinstance(d, list) and len(d) == 2 and all(isinstance(v, int) for v in d)
                                and d[1] == n) for d, n in zip(dsts, sizes))):
                return {"error": "bad_request", "message": "write needs one [address, size] per leased block"}
            self.store.transport.write_to(base64.b64decode(agent), [(e.offset, e.size) for e in lease.entries],
                                          [(a, n) for a, n in dsts])
        except TransferError as e:  # a transfer still in flight may yet land: the puller must not reuse its slots
            return {"error": "TransferError", "message": str(e), "inflight": bool(getattr(e, "inflight", False))}
        finally:
            self.leases.finish(lease)
        return {"ok": True, "bytes": sum(sizes)}

    def _index(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The user's retrieval index on this node: item ids, their blobs' sizes and their embeddings (float32,
        base64), so a puller can pick the top-k itself and then pull exactly those blocks in one round trip. With ``job_dir: true``, the Job's output
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
        size = {r.item_id: r.size for r in self.store.catalogue.items(tenant, user, fp, ids)} if ids else {}
        return {"node": self.store.node, "items": ids, "sizes": [size.get(i, 0) for i in ids],
                "dim": int(m.shape[1]) if ids else 0,
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
