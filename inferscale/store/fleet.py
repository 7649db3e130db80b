"""The fleet path: any serving pod answers any user, fetching the user's blocks on demand.

Retrieval needs the user's embeddings, then the top-k blocks. When this pod holds neither, ``Fleet`` finds a holder:
1. the encoding Job's output dir on this node (``<INFERSCALE_KV_HOST_PATH>/<tenant>/<user>``, the one rule of
   inferscale/jobpaths.py), imported without following symlinks;
2. else the serving peers the operator published to this pod (``PUT /internal/v1/peers``, operator-authenticated:
   a tenant cannot name a peer), asked in turn for the user's index (op ``index``, MACed with the peer secret);
   the first that has the user is the holder, and only the top-k blocks are then leased from it over NIXL UCX,
   verified (sha256, per-block) and cached in this pod's tiers (inferscale/store/pulling.py).
A definite miss (this pod, its Job dir and every peer hold nothing of the user) is a ``NotFoundError``: the user
has no memories, and chat answers it as a first conversation (items [] reported). A peer that could not be asked
makes it a ``TransferError`` (424) instead: never an answer without memories that may exist.

A user pulled partially (only some blocks) is marked on disk (``<store root>/.fleet-partial/<tenant>/<user>``) so
that after a restart its local subset is never taken for the whole list: the index is asked of a peer again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inferscale.errors import ConfigError, InvalidInputError, NotFoundError, TransferError, UnsafePathError
from inferscale.kvformat import KVBlock
from inferscale.store.layout import check_name
from inferscale.store.peer import parse_peer
from inferscale.store.pulling import peer_index
from inferscale.store.results import FetchStats
from inferscale.store.serving import partial_marker

if TYPE_CHECKING:
    from inferscale.store.node import FleetStore

log = logging.getLogger(__name__)
MAX_PEERS = 256


@dataclass
class RemoteIndex:
    ids: list[str]
    matrix: torch.Tensor  # [n, dim] float32
    peer: str
    sizes: dict[str, int]  # item -> its blob's bytes at the peer (a one-round-trip pull)


@dataclass
class Fetched:
    blocks: list[KVBlock]
    stats: FetchStats  # the local store's, of the final read
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    peer: str | None = None


class Fleet:
    """One per serving pod, built with its store (server/app.py) and shared by the tenant and internal apps."""

    def __init__(self, store: FleetStore) -> None:
        self.store = store
        self.peers: list[str] = []
        self.indexes: dict[tuple[str, str, str], RemoteIndex] = {}
        self.lock = threading.Lock()

    # -- the operator's view -----------------------------------------------------------------------------------
    def set_peers(self, peers: list[str]) -> list[str]:
        """Replace the peer list (host:port of other serving pods' NIXL control ports). InvalidInputError (400) on a
        bad one; the list is then unchanged."""
        if len(peers) > MAX_PEERS:
            raise InvalidInputError(f"at most {MAX_PEERS} peers", param="peers")
        for p in peers:
            try:
                parse_peer(p)
            except TransferError as e:
                raise InvalidInputError(str(e), param="peers") from None
        with self.lock:
            self.peers = list(dict.fromkeys(peers))
            return list(self.peers)

    def forget(self, tenant: str, user: str) -> None:
        """The user's blocks changed (a purge): drop what this pod remembers of a peer's index, and the partial
        mark once nothing of the user is left here."""
        with self.lock:
            for key in [k for k in self.indexes if k[:2] == (tenant, user)]:
                del self.indexes[key]
        if not self.store.catalogue.items(tenant, user):
            self._mark(tenant, user, False)

    # -- retrieval's two questions -----------------------------------------------------------------------------
    def embeddings(self, tenant: str, user: str, fingerprint: str) -> tuple[list[str], torch.Tensor]:
        """(ids, [n, dim]) of the user's whole list: local when this pod holds it all, else from a holder."""
        check_name("tenant", tenant), check_name("user", user)
        with self.lock:
            idx = self.indexes.get((tenant, user, fingerprint))
        if idx is not None:
            return idx.ids, idx.matrix
        if not self._partial(tenant, user):
            try:
                return self.store.embeddings(tenant, user, fingerprint)
            except NotFoundError:
                pass
            job_dir = self._local_job_dir(tenant, user)
            if job_dir is not None:  # the encode Job ran on this node: its output is the whole list
                self.store.import_dir(tenant, user, job_dir)
                return self.store.embeddings(tenant, user, fingerprint)
        return self._remote_index(tenant, user, fingerprint)

    def blocks(self, tenant: str, user: str, item_ids: list[str], fingerprint: str) -> Fetched:
        """The blocks of ``item_ids`` (that order); the ones this pod lacks are first leased from the holder
        whose index retrieval used, exactly those, and cached here."""
        with self.lock:
            idx = self.indexes.get((tenant, user, fingerprint))
        pulled = None
        if idx is not None:
            have = {r.item_id for r in self.store.catalogue.items(tenant, user, fingerprint, list(item_ids))
                    if not r.corrupt}
            missing = [i for i in dict.fromkeys(item_ids) if i not in have]
            if missing:
                self._mark(tenant, user, True)  # before the blocks land: a crash must not leave an unmarked subset
                # The holder imported its Job dir when it answered the index: no path travels here.
                try:
                    sizes = [idx.sizes[i] for i in missing] if all(i in idx.sizes for i in missing) else None
                    pulled = self.store.pull_from_peer(tenant, user, idx.peer, missing, fingerprint, sizes=sizes)
                except (TransferError, NotFoundError):  # the holder went away or changed: find one again next time
                    with self.lock:
                        self.indexes.pop((tenant, user, fingerprint), None)
                    raise
        blocks, stats = self.store.get_many(tenant, user, list(item_ids), fingerprint)
        if pulled is None:
            return Fetched(blocks, stats)
        return Fetched(blocks, stats, pulled.blocks, pulled.bytes, idx.peer)

    # -- finding a holder --------------------------------------------------------------------------------------
    def _remote_index(self, tenant: str, user: str, fingerprint: str) -> tuple[list[str], torch.Tensor]:
        with self.lock:
            peers = list(self.peers)
        if self.store.transport is None or not self.store.transport.has_ucx or not peers:
            raise NotFoundError(f"user {user!r} of tenant {tenant!r} has no memories on this pod and it knows no "
                                "peer to fetch them from")
        failures: list[str] = []
        for peer in peers:
            try:
                found = peer_index(self.store, tenant, user, peer, fingerprint)
            except NotFoundError:
                continue
            except (TransferError, UnsafePathError, ConfigError, InvalidInputError) as e:  # an unreachable peer: ask the next one
                log.warning("fleet: peer %s for %s/%s: %s", peer, tenant, user, e)
                failures.append(peer)
                continue
            if not found.ids:
                continue
            with self.lock:
                self.indexes[(tenant, user, fingerprint)] = RemoteIndex(found.ids, found.matrix, peer, found.sizes)
            return found.ids, found.matrix
        if failures:  # a holder may be among them: never answer as if the user had no memories
            raise TransferError(f"user {user!r} of tenant {tenant!r}: not on this pod, and {len(failures)} of its "
                                f"{len(peers)} peer(s) could not be asked; try again")
        raise NotFoundError(f"user {user!r} of tenant {tenant!r} has no memories on this pod or any of its "
                            f"{len(peers)} peer(s)")

    def _local_job_dir(self, tenant: str, user: str) -> Path | None:
        if self.store.job_root is None:
            return None
        path = Path(self.store.job_root) / tenant / user
        return path if path.is_dir() and not path.is_symlink() else None

    def _marker(self, tenant: str, user: str) -> Path:
        return partial_marker(self.store.root, tenant, user)

    def _partial(self, tenant: str, user: str) -> bool:
        return self._marker(tenant, user).exists()

    def _mark(self, tenant: str, user: str, partial: bool) -> None:
        m = self._marker(tenant, user)
        if partial:
            m.parent.mkdir(parents=True, exist_ok=True)
            m.touch()
        else:
            m.unlink(missing_ok=True)
