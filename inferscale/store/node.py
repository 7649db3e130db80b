"""What the store's parts (disk loads, peer pulls, the lessor) use of the node store that builds them: a typed
seam, so that no part imports the facade (``KVStore`` satisfies it structurally)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only; none of these modules imports this one
    import torch

    from inferscale.fleettls import FleetTls
    from inferscale.kvformat import KVBlock
    from inferscale.sealing import Keyring
    from inferscale.store.arena import Arena
    from inferscale.store.blob import BlobInfo
    from inferscale.store.catalogue import Catalogue, ItemInfo
    from inferscale.store.disktier import DiskTier
    from inferscale.store.memrecord import MemoryRecord
    from inferscale.store.nixl_transport import NixlTransport
    from inferscale.store.peer_pool import PeerSessions
    from inferscale.store.results import FetchStats, PullResult
    from inferscale.store.tier import TransferMeter
    from inferscale.store.tiers import DramEntry, DramTier, Key


class StoreNode(Protocol):
    root: Path
    node: str
    keyring: Keyring | None
    job_root: Path | None
    timeout_s: float
    peer_secret: str | None
    peer_tls: FleetTls | None
    arena: Arena
    dram: DramTier
    catalogue: Catalogue
    disk: DiskTier
    transport: NixlTransport | None
    peer_sessions: PeerSessions  # this node's pulls: sessions kept open between them
    hasher: Executor  # checksum and unseal workers
    counters: dict[str, int]
    disk_reader: Callable[[int, memoryview], None] | None  # replaces the disk read when set (throttle.py)
    transfers: dict[str, TransferMeter]  # per tier ("gpu", "dram", "disk"): what each fetch moved and took

    def store_image(self, tenant: str, user: str, image: memoryview, info: BlobInfo, *, cache: bool) -> ItemInfo:
        """Write a verified plain image as the item's current version (disk, and DRAM with ``cache``)."""

    def store_images(self, tenant: str, user: str, images: list[tuple[memoryview, BlobInfo]]) -> list[ItemInfo]:
        """``store_image`` for a batch, to disk only (files staged in parallel, one directory fsync)."""

    def raise_corrupt(self, tenant: str, user: str, items: list[str], *, mark: bool) -> None:
        """Raise BlobCorruptError for ``items`` (marked corrupt in the catalogue with ``mark``)."""

    def pull_result(self, tenant: str, user: str, blocks: int, nbytes: int, tier: str, t0: float) -> PullResult:
        """The PullResult of an import or pull that stored ``blocks`` blocks since ``t0``."""

    def ensure_dram(self, tenant: str, rows: list[ItemInfo], protect: set[Key]
                    ) -> tuple[dict[Key, DramEntry], list[DramEntry], list[Key]]:
        """DRAM entries (one reference each) for ``rows``, loading misses from disk in one batch."""

    def replaced_since(self, key: Key, file_size: int, gens: dict[Key, int]) -> bool:
        """Whether a put of ``key`` since ``gens`` explains a blob file of ``file_size`` bytes."""

    def changed_since(self, key: Key, sha: str, gens: dict[Key, int]) -> bool:
        """Whether a put of ``key`` since ``gens`` explains an intact blob of checksum ``sha``."""

    def embeddings(self, tenant: str, user: str, fingerprint: str) -> tuple[list[str], torch.Tensor]:
        """(item ids, [n, dim] float32) of the user's items."""

    def import_dir(self, tenant: str, user: str, directory: str | Path, items: list[str] | None = None,
                   *, load: bool = True) -> PullResult:
        """Adopt an encoding Job's output directory."""


class FleetStore(StoreNode, Protocol):
    """What the fleet path (inferscale/store/fleet.py) uses besides: the store's reads and peer pulls."""

    def get_many(self, tenant: str, user: str, item_ids: list[str], fingerprint: str, *,
                 copy: bool = False) -> tuple[list[KVBlock], FetchStats]:
        """The blocks of ``item_ids`` from the fastest tier holding each."""

    def pull_from_peer(self, tenant: str, user: str, peer: str, item_ids: list[str] | None = None,
                       fingerprint: str | None = None, *, source_dir: str | None = None,
                       sizes: list[int] | None = None) -> PullResult:
        """Copy a user's blocks from a peer node into this node's tiers (``sizes`` from the peer's index: one
        round trip)."""

    def locate(self, tenant: str, user: str, item_ids: list[str], fingerprint: str) -> dict[str, ItemInfo]:
        """item -> catalogue row with its tiers now, of those of ``item_ids`` stored here: what the planner weighs."""

    def memory_records(self, tenant: str, user: str, item_ids: list[str], fingerprint: str) -> dict[str, MemoryRecord]:
        """item -> memory record (text, token ids) of those of ``item_ids`` stored here, no blob read."""
