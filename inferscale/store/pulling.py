"""Peer pulls (G4, the puller's side): in one authenticated session (inferscale/store/peer.py) lease a user's
blocks at a peer, expose reserved arena slots for exactly them and let the peer's NIXL agent WRITE them there
(one UCX request), verify every checksum, store the good blocks on disk and in DRAM."""

from __future__ import annotations

import base64
import logging
import select
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from inferscale.errors import ConfigError, NotFoundError, TransferError, UnsafePathError
from inferscale.store.diskload import verify_slots
from inferscale.store.layout import check_fingerprint, check_name

if TYPE_CHECKING:
    from inferscale.store.nixl_transport import NixlTransport
    from inferscale.store.node import StoreNode
    from inferscale.store.peer import PeerSession
    from inferscale.store.results import PullResult

log = logging.getLogger(__name__)


def pull_from_peer(store: StoreNode, tenant: str, user: str, peer: str, item_ids: list[str] | None,
                   fingerprint: str | None, source_dir: str | None) -> PullResult:
    t0 = time.perf_counter()
    check_name("tenant", tenant), check_name("user", user)
    for i in item_ids or []:
        check_name("item", i)
    if fingerprint is not None:
        check_fingerprint(fingerprint)
    blocks, offsets = fetch_leased(store, tenant, user, peer, item_ids, fingerprint, source_dir)
    good, bad = verify_slots(
        store, tenant, [(o, b["size"], f"peer {peer} {tenant}/{user}/{b['item']}", b["sha256"], b["item"],
                  b["fingerprint"]) for o, b in zip(offsets, blocks)])
    try:
        store.store_images(tenant, user, [(store.arena.view(off, size), info) for off, size, info in good])
    except BaseException:  # e.g. a full disk: give back every slot (the items written load from disk)
        for o, s, _ in good:
            store.dram.abort(tenant, [o], [s])
        raise
    nbytes = 0
    for off, size, info in good:
        store.dram.release(store.dram.commit((tenant, user, info.fingerprint, info.item_id), off, size, info))
        nbytes += size
    store.counters["peer_pulls"] += len(good)
    if bad:
        store.raise_corrupt(tenant, user, bad, mark=True)
    return store.pull_result(tenant, user, len(good), nbytes, "dram", t0)


def _reply_error(peer: str, reply: dict[str, Any]) -> None:
    """Raise the typed error an (authenticated) error reply stands for."""
    if reply.get("error") == "not_found":
        raise NotFoundError(f"peer {peer}: {reply.get('message')}")
    if reply.get("error") == "UnsafePathError":  # the peer refused the Job dir by the shared rule
        raise UnsafePathError(f"peer {peer}: {reply.get('message')}", param="source.dir")
    if "error" in reply:
        raise TransferError(f"peer {peer}: {reply.get('error')}: {reply.get('message')}")


def fetch_leased(store: StoreNode, tenant: str, user: str, peer: str, item_ids: list[str] | None,
                 fingerprint: str | None, source_dir: str | None) -> tuple[list[dict[str, Any]], list[int]]:
    """In one session (kept open between pulls, inferscale/store/peer_pool.py): lease the blocks at the peer,
    reserve arena slots, expose exactly them and have the peer WRITE the blocks into them. Returns (the peer's
    block records, slot offsets); unverified, uncommitted."""
    transport = store.transport
    if transport is None or not transport.has_ucx:
        raise ConfigError("peer pulls need the NIXL UCX backend (KVStore(nixl=True))")
    pool = store.peer_sessions
    session, reply = pool.call_fresh(peer, peer_secret(store), store.timeout_s,
                                     {"op": "locate", "tenant": tenant, "user": user, "items": item_ids,
                                      "fingerprint": fingerprint, "dir": source_dir})
    clean = reply.get("error") == "not_found"  # answered, no lease: the session stays good
    try:
        _reply_error(peer, reply)
        lease, blocks = reply.get("lease"), reply.get("blocks")
        if not isinstance(lease, str) or not isinstance(blocks, list):
            raise TransferError(f"peer {peer}: malformed lease reply")
        offsets = _written(store, session, peer, tenant, lease, [b["size"] for b in blocks])
        clean = True
    finally:  # a session that failed anywhere is closed (the peer ends its lease); a clean one is kept
        if clean:
            pool.give_back(session, 2)
        else:
            session.close()
    return blocks, offsets


def _written(store: StoreNode, session: PeerSession, peer: str, tenant: str, lease: str, sizes: list[int]) -> list[int]:
    """Reserve arena slots for the leased blocks, expose exactly them and have the peer WRITE the blocks there;
    the slot offsets (withheld, never reused, while the peer's transfer may still be in flight)."""
    transport = store.transport
    offsets, _ = store.dram.reserve(tenant, sizes)
    written = inflight = False
    try:
        exposure = transport.expose(offsets, sizes)
        try:
            notif = f"lease:{lease}".encode()
            inflight = True  # until the owner answers: its transfer may still be under way
            done = session.call({"op": "write", "lease": lease, "agent": base64.b64encode(exposure.metadata).decode(),
                                 "dsts": [list(r) for r in exposure.ranges]}, progress=_progress(transport, session))
            inflight = done.get("inflight") is True
            _reply_error(peer, done)
            # The owner's transfer is done; its notification follows the bytes.
            if not transport.wait_notif(notif, time.monotonic() + store.timeout_s):
                raise TransferError(f"peer {peer}: the write's completion never arrived")
            written = True
        finally:
            transport.unexpose(exposure)
    finally:
        if inflight:  # the owner's transfer may still land: withhold the slots, never reuse them
            log.warning("pull from %s: %d slot(s) of %s withheld (a transfer in flight)", peer, len(offsets), tenant)
        elif not written:
            store.dram.abort(tenant, offsets, sizes)
    return offsets


def _progress(transport: NixlTransport, session: PeerSession) -> Callable[[], None]:
    """What a puller runs while the owner's WRITE is under way: progress its agent (UCX's TCP transport needs
    the target to progress; CMA and RDMA do not), then wait for the owner's reply on the socket, at first
    0.2 ms, doubling to at most 2 ms: a reply ends the wait at once, and a long CMA copy costs the puller a few
    dozen wake-ups instead of thousands (each took CPU from the owner's copy on a busy node)."""
    wait = [0.0002]

    def progress() -> None:
        transport.poll_notifs()
        select.select([session.sock], [], [], wait[0])
        wait[0] = min(2 * wait[0], 0.002)

    return progress


def peer_secret(store: StoreNode) -> str:
    if not store.peer_secret:
        raise ConfigError("peer pulls need INFERSCALE_PEER_SECRET (KVStore(peer_secret=...))")
    return store.peer_secret


def peer_index(store: StoreNode, tenant: str, user: str, peer: str, fingerprint: str,
               job_dir: bool = True) -> tuple[list[str], Any]:
    """(item ids, [n, dim] float32 embeddings) of the user at ``peer`` (op ``index``): what a puller ranks before
    leasing exactly the top-k blocks. ``job_dir``: the peer first imports its own node's Job output dir for the
    user, if there is one. NotFoundError when the peer holds nothing of the user (or only part of it)."""
    import torch

    check_name("tenant", tenant), check_name("user", user), check_fingerprint(fingerprint)
    session, reply = store.peer_sessions.call_fresh(
        peer, peer_secret(store), store.timeout_s,
        {"op": "index", "tenant": tenant, "user": user, "fingerprint": fingerprint, "job_dir": job_dir})
    if "error" in reply and reply.get("error") != "not_found":
        session.close()
    else:
        store.peer_sessions.give_back(session, 2)
    _reply_error(peer, reply)
    ids, dim = reply.get("items"), reply.get("dim")
    if not isinstance(ids, list) or not isinstance(dim, int) or dim < 0:
        raise TransferError(f"peer {peer}: malformed index reply")
    for i in ids:
        check_name("item", i)
    raw = base64.b64decode(reply.get("embeddings") or "")
    if len(raw) != 4 * dim * len(ids):
        raise TransferError(f"peer {peer}: index of {len(ids)} item(s) x {dim} has {len(raw)} bytes")
    if not ids:
        return [], torch.empty(0, 0, dtype=torch.float32)
    return ids, torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(len(ids), dim)
