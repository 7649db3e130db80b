"""Peer pulls (G4, the puller's side): in one authenticated session (inferscale/store/peer.py) lease a user's
blocks at a peer, expose reserved arena slots for exactly them and let the peer's NIXL agent WRITE them there
(one UCX request), verify every checksum, store the good blocks on disk and in DRAM."""

from __future__ import annotations

import base64
import logging
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from inferscale.errors import ConfigError, NotFoundError, TransferError, UnsafePathError
from inferscale.store.diskload import verify_slots
from inferscale.store.layout import check_fingerprint, check_name
from inferscale.store.peer import session_closed

if TYPE_CHECKING:
    from inferscale.store.nixl_transport import NixlTransport
    from inferscale.store.node import StoreNode
    from inferscale.store.peer import PeerSession
    from inferscale.store.results import PullResult

log = logging.getLogger(__name__)


def pull_from_peer(store: StoreNode, tenant: str, user: str, peer: str, item_ids: list[str] | None,
                   fingerprint: str | None, source_dir: str | None, sizes: list[int] | None = None) -> PullResult:
    t0 = time.perf_counter()
    check_name("tenant", tenant), check_name("user", user)
    for i in item_ids or []:
        check_name("item", i)
    if fingerprint is not None:
        check_fingerprint(fingerprint)
    blocks, offsets = fetch_leased(store, tenant, user, peer, item_ids, fingerprint, source_dir, sizes)
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
    if reply.get("error") == "changed":
        raise _SizesChanged(f"peer {peer}: {reply.get('message')}")
    if reply.get("error") == "not_found":
        raise NotFoundError(f"peer {peer}: {reply.get('message')}")
    if reply.get("error") == "UnsafePathError":  # the peer refused the Job dir by the shared rule
        raise UnsafePathError(f"peer {peer}: {reply.get('message')}", param="source.dir")
    if "error" in reply:
        raise TransferError(f"peer {peer}: {reply.get('error')}: {reply.get('message')}")


def fetch_leased(store: StoreNode, tenant: str, user: str, peer: str, item_ids: list[str] | None,
                 fingerprint: str | None, source_dir: str | None,
                 sizes: list[int] | None = None) -> tuple[list[dict[str, Any]], list[int]]:
    """In one session (kept open between pulls, inferscale/store/peer_pool.py): lease the blocks at the peer,
    reserve arena slots, expose exactly them and have the peer WRITE the blocks into them. Returns (the peer's
    block records, slot offsets); unverified, uncommitted.

    With the blocks' ``sizes`` known (the peer's index gave them: the fleet path) and a kept session with the
    peer, it is one round trip, op ``pull``: the slots are exposed first and the owner leases and writes them in
    one request. Otherwise, or when the owner says they changed since, two: ``locate`` (the lease and its sizes,
    in a MACed reply), then ``write``."""
    transport = store.transport
    if transport is None or not transport.has_ucx:
        raise ConfigError("peer pulls need the NIXL UCX backend (KVStore(nixl=True))")
    if sizes is not None and item_ids and fingerprint is not None and source_dir is None:
        if len(sizes) != len(item_ids):
            raise ValueError("one size per item")
        try:
            pulled = _pulled(store, tenant, user, peer, item_ids, fingerprint, sizes)
        except _SizesChanged:
            log.info("pull from %s: %s/%s changed since its index; leasing it afresh", peer, tenant, user)
            pulled = None
        if pulled is not None:
            return pulled
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
        offsets, _ = _written(store, session, peer, tenant, [b["size"] for b in blocks],
                              lambda dsts: {"op": "write", "lease": lease, **dsts})
        clean = True
    finally:  # a session that failed anywhere is closed (the peer ends its lease); a clean one is kept
        if clean:
            pool.give_back(session, 2)
        else:
            session.close()
    return blocks, offsets


class _SizesChanged(TransferError):
    """The owner's blocks are not the sizes the puller exposed slots for (re-encoded since its index)."""


def _pulled(store: StoreNode, tenant: str, user: str, peer: str, item_ids: list[str], fingerprint: str,
            sizes: list[int]) -> tuple[list[dict[str, Any]], list[int]] | None:
    """Op ``pull``: one round trip, in a kept session, or None when there is none. The request carries the
    puller's NIXL metadata, which names its UCX worker (whose TCP and CMA transports do not bound a write by the
    registration): it goes only to an owner that proved the secret in this session already (a verified reply),
    never in a fresh session's first request. A kept session the peer closed meanwhile (its EOF is readable)
    is dropped first."""
    pool = store.peer_sessions
    session, kept = pool.take(peer, peer_secret(store), store.timeout_s)
    if not kept or session_closed(session):
        session.close()
        return None
    clean = False
    try:
        offsets, done = _written(store, session, peer, tenant, sizes,
                                 lambda dsts: {"op": "pull", "tenant": tenant, "user": user, "items": item_ids,
                                               "fingerprint": fingerprint, "sizes": sizes, **dsts})
        clean = True
    except _SizesChanged:
        clean = True  # an authenticated answer: the session stays good
        raise
    finally:
        if clean:
            pool.give_back(session, 2)
        else:
            session.close()
    sums = done.get("sha256")
    if not isinstance(sums, list) or len(sums) != len(sizes) or any(not isinstance(h, str) for h in sums):
        store.dram.abort(tenant, offsets, sizes)
        raise TransferError(f"peer {peer}: malformed pull reply")
    return [{"item": i, "fingerprint": fingerprint, "size": n, "sha256": h}
            for i, n, h in zip(item_ids, sizes, sums)], offsets


def _written(store: StoreNode, session: PeerSession, peer: str, tenant: str, sizes: list[int],
             request: Callable[[dict[str, Any]], dict[str, Any]]) -> tuple[list[int], dict[str, Any]]:
    """Reserve arena slots for blocks of ``sizes``, expose exactly them and send ``request(exposure fields)``,
    whose reply says the peer WROTE the blocks there. (The slot offsets (withheld, never reused, while the
    peer's transfer may still be in flight), the reply.)"""
    transport = store.transport
    offsets, _ = store.dram.reserve(tenant, sizes)
    written = inflight = False
    try:
        exposure = transport.expose(offsets, sizes)
        try:
            inflight = True  # until the owner answers: its transfer may still be under way
            done = session.call(request({"agent": base64.b64encode(exposure.metadata).decode(),
                                         "dsts": [list(r) for r in exposure.ranges]}),
                                progress=_progress(transport, session))
            inflight = done.get("inflight") is True
            _reply_error(peer, done)  # an ok reply comes after the owner's WRITE completed here (a UCX flush)
            if done.get("ok") is not True:
                raise TransferError(f"peer {peer}: malformed write reply")
            written = True
        finally:
            transport.unexpose(exposure)
    finally:
        if inflight:  # the owner's transfer may still land: withhold the slots, never reuse them
            log.warning("pull from %s: %d slot(s) of %s withheld (a transfer in flight)", peer, len(offsets), tenant)
        elif not written:
            store.dram.abort(tenant, offsets, sizes)
    return offsets, done


def _progress(transport: NixlTransport, session: PeerSession) -> Callable[[], None]:
    """What a puller runs while the owner's WRITE is under way: progress its agent (UCX's TCP transport needs
    the target to progress; CMA and RDMA do not), then wait for the owner's reply on the socket, at first
    0.2 ms, doubling to at most 2 ms: a reply ends the wait at once, and a long CMA copy costs the puller a few
    dozen wake-ups instead of thousands (each took CPU from the owner's copy on a busy node)."""
    wait = [0.0002]

    def progress() -> None:
        transport.progress()
        select.select([session.sock], [], [], wait[0])
        wait[0] = min(2 * wait[0], 0.002)

    return progress


def peer_secret(store: StoreNode) -> str:
    if not store.peer_secret:
        raise ConfigError("peer pulls need INFERSCALE_PEER_SECRET (KVStore(peer_secret=...))")
    return store.peer_secret


@dataclass
class PeerIndex:
    """A user's retrieval index at a peer (op ``index``)."""

    ids: list[str]
    matrix: torch.Tensor  # [n, dim] float32
    sizes: dict[str, int]  # item -> its blob's bytes there: what a one-round-trip pull exposes slots for


def peer_index(store: StoreNode, tenant: str, user: str, peer: str, fingerprint: str,
               job_dir: bool = True) -> PeerIndex:
    """The user's index at ``peer`` (op ``index``): what a puller ranks before pulling exactly the top-k blocks.
    ``job_dir``: the peer first imports its own node's Job output dir for the user, if there is one.
    NotFoundError when the peer holds nothing of the user (or only part of it)."""
    check_name("tenant", tenant), check_name("user", user), check_fingerprint(fingerprint)
    session, reply = store.peer_sessions.call_fresh(
        peer, peer_secret(store), store.timeout_s,
        {"op": "index", "tenant": tenant, "user": user, "fingerprint": fingerprint, "job_dir": job_dir})
    if "error" in reply and reply.get("error") != "not_found":
        session.close()
    else:
        store.peer_sessions.give_back(session, 2)
    _reply_error(peer, reply)
    ids, dim, sizes = reply.get("items"), reply.get("dim"), reply.get("sizes")
    if (not isinstance(ids, list) or not isinstance(dim, int) or dim < 0 or not isinstance(sizes, list)
            or len(sizes) != len(ids) or any(not isinstance(n, int) or n < 0 for n in sizes)):
        raise TransferError(f"peer {peer}: malformed index reply")
    for i in ids:
        check_name("item", i)
    raw = base64.b64decode(reply.get("embeddings") or "")
    if len(raw) != 4 * dim * len(ids):
        raise TransferError(f"peer {peer}: index of {len(ids)} item(s) x {dim} has {len(raw)} bytes")
    if not ids:
        return PeerIndex([], torch.empty(0, 0, dtype=torch.float32), {})
    matrix = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(len(ids), dim)
    return PeerIndex(ids, matrix, dict(zip(ids, sizes)))
