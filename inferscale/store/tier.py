"""The one small interface of a cache tier above disk (G2 DRAM, G1 device), and the meter of a tier's transfers.

A tier caches blocks, not users: which blocks it keeps is decided by its ``BlockCache`` (frequency-filtered
admission, LRU eviction, a byte budget, tenant shares, pins), and the tier only moves the bytes. Disk is the
source of record: dropping a cached copy loses nothing. Each tier is built with its collaborators (its arena or
device, its cache) and none reaches into another's state; ``KVStore`` walks them fastest first.

``TransferMeter`` is what the store measured of one tier's transfers (blocks, bytes, seconds of each fetch
served from it), for a fetch-or-recompute planner to learn from (``subscribe``) and for benches to read."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only
    from inferscale.store.blockcache import BlockCache

Key = tuple[str, str, str, str]  # tenant, user, fingerprint, item
TransferListener = Callable[[str, int, int, float], None]  # (tier, blocks, bytes, seconds) of one fetch


@dataclass(frozen=True)
class TransferTotals:
    """Sums over a meter's fetches since the store opened (subtract two snapshots for an interval)."""

    fetches: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def minus(self, earlier: TransferTotals) -> TransferTotals:
        return TransferTotals(self.fetches - earlier.fetches, self.blocks - earlier.blocks,
                              self.bytes - earlier.bytes, self.seconds - earlier.seconds)


class TransferMeter:
    """Blocks, bytes and seconds of the fetches served from one tier (``gpu``, ``dram`` or ``disk``, the
    ``FetchPlanner`` tier names). One ``record`` per fetch: the blocks one ``get_many`` took from that tier."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._totals = TransferTotals()
        self._listeners: list[TransferListener] = []

    def record(self, blocks: int, nbytes: int, seconds: float) -> None:
        if blocks <= 0:
            return
        with self._lock:
            t = self._totals
            self._totals = TransferTotals(t.fetches + 1, t.blocks + blocks, t.bytes + nbytes, t.seconds + seconds)
            listeners = list(self._listeners)
        for fn in listeners:  # outside the lock: a listener may take its own
            fn(self.tier, blocks, nbytes, seconds)

    def subscribe(self, fn: TransferListener) -> None:
        """Call ``fn(tier, blocks, bytes, seconds)`` after every fetch from this tier (in the fetching thread)."""
        with self._lock:
            self._listeners.append(fn)

    def totals(self) -> TransferTotals:
        with self._lock:
            return self._totals


class PinnedKeys:
    """The keys ``KVStore.pin`` pinned in one tier, each held as one pin of its cache (in-flight readers add
    their own). Not thread-safe: the tier's lock guards it."""

    def __init__(self, cache: BlockCache) -> None:
        self.cache = cache
        self.keys: set[Key] = set()

    def set(self, keys: list[Key], on: bool) -> None:
        for k in keys:
            if on and k not in self.keys:
                self.keys.add(k)
                self.cache.pin(k)
            elif not on and k in self.keys:
                self.keys.discard(k)
                self.cache.unpin(k)


def set_share(cache: BlockCache, tenant: str, nbytes: int | None) -> None:
    """``tenant``'s byte share of a tier's cache; None: the cache's default share."""
    cache.tenant_shares[tenant] = nbytes if nbytes is not None else cache.default_share


class CacheTier(Protocol):
    """What ``KVStore`` (and the planner, benches) use of a cache tier. DRAM: ``store.tiers.DramTier``; device:
    ``store.tiers.DeviceTier``. Reads and writes of bytes are tier-specific (arena slots, device tensors)."""

    name: str  # "dram" | "gpu"
    cache: BlockCache  # residency policy; its ``stats`` count hits, misses, admissions, refusals, evictions
    transfers: TransferMeter  # fetches served from this tier

    def resident(self, key: Key) -> bool:
        """Whether a copy of ``key`` is cached here now."""

    def set_share(self, tenant: str, nbytes: int | None) -> None:
        """``tenant``'s byte share of this tier (None: the tier's default share)."""

    def set_pinned(self, keys: list[Key], on: bool) -> None:
        """Pin (never evict) or unpin ``keys`` for as long as the store's pin flag says (``KVStore.pin``)."""

    def drop(self, pred: Callable[[Key], bool]) -> list[Key]:
        """Drop every cached copy whose key satisfies ``pred`` (delete, re-put); returns the keys dropped."""

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes of ``tenant``'s blocks cached here."""

    def stats(self) -> dict[str, int]:
        """Blocks, bytes, budget and the cache's counters, prefixed with the tier's name."""
