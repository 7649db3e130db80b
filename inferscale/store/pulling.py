"""Peer pulls (G4, the puller's side): ask a peer's metadata service for a lease on a user's blocks (a MACed
request, inferscale/store/peer.py), READ the leased staging copy in one NIXL UCX request into reserved arena
slots, verify every checksum, store the good blocks on disk and in DRAM."""

from __future__ import annotations

import base64
import logging
import time
from typing import TYPE_CHECKING, Any

from inferscale.errors import ConfigError, NotFoundError, TransferError, UnsafePathError
from inferscale.store import peer as peerproto
from inferscale.store.layout import check_fingerprint, check_name

if TYPE_CHECKING:
    from inferscale.store.store import KVStore, PullResult

log = logging.getLogger(__name__)


def pull_from_peer(store: KVStore, tenant: str, user: str, peer: str, item_ids: list[str] | None,
                   fingerprint: str | None, source_dir: str | None) -> PullResult:
    t0 = time.perf_counter()
    check_name("tenant", tenant), check_name("user", user)
    for i in item_ids or []:
        check_name("item", i)
    if fingerprint is not None:
        check_fingerprint(fingerprint)
    blocks, offsets = fetch_leased(store, tenant, user, peer, item_ids, fingerprint, source_dir)
    good, bad = store._verify_slots(
        tenant, [(o, b["size"], f"peer {peer} {tenant}/{user}/{b['item']}", b["sha256"], b["item"],
                  b["fingerprint"]) for o, b in zip(offsets, blocks)])
    nbytes = 0
    for n, (off, size, info) in enumerate(good):
        try:
            store._store_image(tenant, user, store.arena.view(off, size), info, cache=False)
        except BaseException:  # e.g. a full disk: give back the slots not committed yet
            for o, s, _ in good[n:]:
                store.dram.abort(tenant, [o], [s])
            raise
        key = (tenant, user, info.fingerprint, info.item_id)
        store.dram.release(store.dram.commit(key, off, size, info))
        nbytes += size
    store.catalogue.set_flag([(tenant, user, i.fingerprint, i.item_id) for _, _, i in good], "dram", 1)
    store._counters["peer_pulls"] += len(good)
    if bad:
        store._raise_corrupt(tenant, user, bad, mark=True)
    return store._result(tenant, user, len(good), nbytes, "dram", t0)


def fetch_leased(store: KVStore, tenant: str, user: str, peer: str, item_ids: list[str] | None,
           fingerprint: str | None, source_dir: str | None) -> tuple[list[dict[str, Any]], list[int]]:
    """Get a lease on the blocks at the peer, READ them all in one NIXL request into reserved arena slots, end
    the lease. Returns (the peer's block records, slot offsets); the slots are unverified and uncommitted."""
    if store.transport is None or not store.transport.has_ucx:
        raise ConfigError("peer pulls need the NIXL UCX backend (KVStore(nixl=True))")
    reply = peerproto.request(peer, {"op": "locate", "tenant": tenant, "user": user, "items": item_ids,
                                     "fingerprint": fingerprint, "dir": source_dir},
                              store.timeout_s, store.peer_secret)
    if reply.get("error") == "not_found":
        raise NotFoundError(f"peer {peer}: {reply.get('message')}")
    if reply.get("error") == "UnsafePathError":  # the peer refused the Job dir by the shared rule
        raise UnsafePathError(f"peer {peer}: {reply.get('message')}", param="source.dir")
    if "error" in reply:
        raise TransferError(f"peer {peer}: {reply.get('error')}: {reply.get('message')}")
    lease, blocks = reply["lease"], reply["blocks"]
    done = False
    try:
        sizes = [b["size"] for b in blocks]
        offsets, evicted = store.dram.reserve(tenant, sizes)
        try:
            # The completion notification ends the peer's lease: no extra round trip on success.
            store.transport.read_leased(base64.b64decode(reply["agent"]), [(b["addr"], b["size"]) for b in blocks],
                                        offsets, notif=f"lease:{lease}".encode())
            done = True
        except TransferError as e:
            if not getattr(e, "inflight", False):  # a transfer still in flight may yet write: leak, not reuse
                store.dram.abort(tenant, offsets, sizes)
            raise
    finally:
        if not done:
            try:
                peerproto.request(peer, {"op": "release", "lease": lease}, store.timeout_s, store.peer_secret)
            except TransferError as e:
                log.warning("releasing lease at %s: %s", peer, e)
    store.catalogue.record([], {("dram", 0): evicted})
    return blocks, offsets


def peer_index(store: KVStore, tenant: str, user: str, peer: str, fingerprint: str,
               job_dir: bool = True) -> tuple[list[str], Any]:
    """(item ids, [n, dim] float32 embeddings) of the user at ``peer`` (op ``index``): what a puller ranks before
    leasing exactly the top-k blocks. ``job_dir``: the peer first imports its own node's Job output dir for the
    user, if there is one. NotFoundError when the peer holds nothing of the user (or only part of it)."""
    import torch

    check_name("tenant", tenant), check_name("user", user), check_fingerprint(fingerprint)
    reply = peerproto.request(peer, {"op": "index", "tenant": tenant, "user": user, "fingerprint": fingerprint,
                                     "job_dir": job_dir}, store.timeout_s, store.peer_secret)
    if reply.get("error") == "not_found":
        raise NotFoundError(f"peer {peer}: {reply.get('message')}")
    if reply.get("error") == "UnsafePathError":
        raise UnsafePathError(f"peer {peer}: {reply.get('message')}", param="source.dir")
    if "error" in reply:
        raise TransferError(f"peer {peer}: {reply.get('error')}: {reply.get('message')}")
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
