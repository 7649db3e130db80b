"""Peer pulls (G4, the puller's side): in one authenticated session (inferscale/store/peer.py) lease a user's
blocks at a peer, expose reserved arena slots for exactly them and let the peer's NIXL agent WRITE them there
(one UCX request), verify every checksum, store the good blocks on disk and in DRAM."""

from __future__ import annotations

import base64
import logging
import time
from typing import TYPE_CHECKING, Any

from inferscale.errors import ConfigError, NotFoundError, TransferError, UnsafePathError
from inferscale.store import peer as peerproto
from inferscale.store.diskload import verify_slots
from inferscale.store.layout import check_fingerprint, check_name

if TYPE_CHECKING:
    from inferscale.store.node import StoreNode
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
    """In one session: lease the blocks at the peer, reserve arena slots, expose exactly them and have the peer
    WRITE the blocks into them. Returns (the peer's block records, slot offsets); unverified, uncommitted."""
    transport = store.transport
    if transport is None or not transport.has_ucx:
        raise ConfigError("peer pulls need the NIXL UCX backend (KVStore(nixl=True))")
    with peerproto.PeerSession(peer, peer_secret(store), store.timeout_s, store.peer_tls) as session:
        reply = session.call({"op": "locate", "tenant": tenant, "user": user, "items": item_ids,
                              "fingerprint": fingerprint, "dir": source_dir})
        _reply_error(peer, reply)
        lease, blocks = reply.get("lease"), reply.get("blocks")
        if not isinstance(lease, str) or not isinstance(blocks, list):
            raise TransferError(f"peer {peer}: malformed lease reply")
        sizes = [b["size"] for b in blocks]
        offsets, _ = store.dram.reserve(tenant, sizes)
        written = inflight = False
        try:
            exposure = transport.expose(offsets, sizes)
            try:
                notif = f"lease:{lease}".encode()
                inflight = True  # until the owner answers: its transfer may still be under way
                done = session.call({"op": "write", "lease": lease, "agent": base64.b64encode(exposure.metadata).decode(),
                                     "dsts": [list(r) for r in exposure.ranges]}, progress=transport.poll_notifs)
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
    return blocks, offsets


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
    reply = peerproto.request(peer, {"op": "index", "tenant": tenant, "user": user, "fingerprint": fingerprint,
                                     "job_dir": job_dir}, store.timeout_s, peer_secret(store), store.peer_tls)
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
