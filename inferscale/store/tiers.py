"""G2, the DRAM tier: blob images in one arena (registered once with NIXL), cached per block.

Which blocks stay is its ``BlockCache``'s decision (``store.blockcache``: frequency-filtered admission, LRU
eviction, the byte budget, tenant shares, pins); this module only places bytes. Every reader holds a reference
(one cache pin each): an in-use block is never evicted, and a slot is reused only once its last view is gone. A
block the filter refuses is read into a buffer of its own outside the arena, serves the request that read it and
is freed after: it never displaces a hotter block. Eviction only drops the cached copy:
the disk tier (G3) always keeps the blob."""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from inferscale import kvquant
from inferscale.blobimage import array_tensor, shaped_array
from inferscale.errors import QuotaExceededError
from inferscale.kvformat import KVBlock, block_from_views
from inferscale.store.arena import Arena, align_up
from inferscale.store.blob import BlobInfo
from inferscale.store.blockcache import BlockCache
from inferscale.store.tier import Key, PinnedKeys, TransferMeter, set_share

__all__ = ["FRAGMENTATION_FRACTION", "DramEntry", "DramTier", "Key"]
# Arena room above the cache budget, for slots the cache does not count (a transfer's reservations, entries still
# read after eviction) and for fragmentation: without it, blocks of different sizes would often find no hole
# big enough and push out more than the cache decided.
FRAGMENTATION_FRACTION = 8


@dataclass(eq=False)
class DramEntry:
    key: Key
    offset: int  # in the arena
    size: int  # blob bytes
    info: BlobInfo
    refs: int = 0  # readers (leased views, peer transfers); an entry with refs is never reused
    dead: bool = False  # evicted, replaced or never admitted; its bytes are freed when refs reach 0
    # The embedding, copied out of the slot on the first read and shared by every later reader (they only read
    # it: retrieval stacks it), so a hit copies nothing.
    embedding: torch.Tensor | None = None


class DramTier:
    """The ``CacheTier`` of DRAM (``store.tier``). Slots: ``admit_misses`` (a read's misses, filtered),
    ``offer`` (a put or warm-up, filtered, never bypassed), ``reserve`` (a transfer's slots, made room for now and
    offered at ``commit``); then ``commit`` or ``abort`` each."""

    name = "dram"

    def __init__(self, arena: Arena, cache: BlockCache) -> None:
        self.arena, self.cache = arena, cache
        self.transfers = TransferMeter(self.name)
        self.lock = threading.Lock()
        self._entries: dict[Key, DramEntry] = {}
        self._pending: dict[int, Key] = {}  # reserved slot -> the key admitted for it (pinned until committed)
        self._bypass: set[int] = set()  # reserved slots the filter refused: they serve one request only
        self._private: dict[int, np.ndarray] = {}  # those slots' own buffers, under negative offsets
        self._next_private = -1
        self._pinned = PinnedKeys(cache)  # KVStore.pin
        self.bypassed = 0
        # Bumped on every put/delete of a key: a load that raced with one must not cache the old bytes.
        self._gen: dict[Key, int] = defaultdict(int)
        # Releases from finalizers land here (lock-free) and are applied under the lock: a finalizer can run
        # in any thread at any time, including while this thread holds the lock.
        self._released: deque[DramEntry] = deque()

    @staticmethod
    def arena_bytes(budget: int) -> int:
        """The arena a budget needs: the cached blocks plus room against fragmentation."""
        return budget + budget // FRAGMENTATION_FRACTION

    @property
    def tenant_quotas(self) -> dict[str, int | None]:  # per-tenant shares set (the server's tenants file)
        return dict(self.cache.tenant_shares)

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def _drain(self) -> None:
        while self._released:
            self._unref(self._released.popleft())

    def _ref(self, e: DramEntry) -> None:
        e.refs += 1
        self.cache.pin(e.key)

    def _unref(self, e: DramEntry) -> None:
        e.refs -= 1
        self.cache.unpin(e.key)
        if e.dead and e.refs == 0:
            self._free(e)

    def _free(self, e: DramEntry) -> None:
        if e.offset < 0:
            self._private.pop(e.offset, None)
        else:
            self.arena.allocator.free(e.offset, e.size)

    def view(self, offset: int, n: int) -> memoryview:
        """The bytes of a slot: in the arena, or a bypassed block's own buffer (negative offsets)."""
        return memoryview(self._private[offset][:n]) if offset < 0 else self.arena.view(offset, n)

    @staticmethod
    def in_arena(offset: int) -> bool:  # else a bypassed block's own buffer: no transport reaches it
        return offset >= 0

    def _evict(self, key: Key, evicted: list[Key] | None = None) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            e.dead = True
            if e.refs == 0:
                self._free(e)
        if evicted is not None:
            evicted.append(key)

    # -- reads ----------------------------------------------------------------------------------------------
    def acquire(self, key: Key, size: int = 0) -> DramEntry | None:
        """The resident entry for ``key`` with one reference taken (release it, or hand it to lease_block); a
        read either way, counted in the cache's frequency sketch (``size``: the block's bytes, for a miss)."""
        return self.acquire_many([key], [size])[0]

    def release(self, e: DramEntry) -> None:
        self._released.append(e)
        if self.lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self.lock.release()

    def acquire_many(self, keys: list[Key], sizes: list[int]) -> list[DramEntry | None]:
        """``acquire`` of each key under one lock: the resident entries (one reference each), None for misses."""
        out: list[DramEntry | None] = []
        with self.lock:
            self._drain()
            for key, size in zip(keys, sizes):
                e = self._entries.get(key)
                self.cache.lookup(key, e.size if e is not None else size)
                if e is not None:
                    self._ref(e)
                out.append(e)
        return out

    def acquire_all(self, keys: list[Key]) -> list[DramEntry] | None:
        """Every key's resident entry (one reference each, each lookup counted), or None, with nothing taken or
        counted, when any of them is not resident: an all-DRAM request's one locked pass."""
        with self.lock:
            self._drain()
            got = [self._entries.get(k) for k in keys]
            if None in got:
                return None
            for e in got:
                self.cache.lookup(e.key, e.size)
                self._ref(e)
            return got

    def lease_block(self, e: DramEntry) -> KVBlock:
        """The entry's block, its kv (and scales) zero-copy views that own the caller's reference: the slot
        cannot be reused while any tensor viewing it is alive."""
        info = e.info
        kv = self._lease(e, info.kv_range, info.kv_dtype, info.kv_shape)
        scale = None
        if info.scale_range is not None:
            with self.lock:  # the scales' view holds a reference of its own
                self._ref(e)
            scale = self._lease(e, info.scale_range, kvquant.SCALE_DTYPE, info.scale_shape)
        return block_from_views(info, kv, scale, self._embedding(e))

    def _lease(self, e: DramEntry, byte_range: tuple[int, int], dtype: torch.dtype, shape: tuple[int, ...]
               ) -> torch.Tensor:
        arr = shaped_array(self._bytes(e, byte_range), dtype, shape)
        weakref.finalize(arr, self.release, e)  # the tensor holds ``arr`` itself
        return array_tensor(arr, dtype)

    def _embedding(self, e: DramEntry) -> torch.Tensor | None:
        if e.embedding is None and e.info.emb_range is not None:
            raw = self._bytes(e, e.info.emb_range).copy()
            e.embedding = torch.from_numpy(raw).view(torch.float32).view(e.info.emb_shape)
        return e.embedding

    def _bytes(self, e: DramEntry, byte_range: tuple[int, int]) -> np.ndarray:
        """The entry's bytes [a, b) of its image, in its arena slot or its private buffer (zero-copy)."""
        a, b = byte_range
        if e.offset < 0:
            return self._private[e.offset][a:b]
        return self.arena.np[e.offset + a : e.offset + b]

    # -- writes ---------------------------------------------------------------------------------------------
    def admit_misses(self, tenant: str, keys: list[Key], sizes: list[int], protect: set[Key] = frozenset(),
                     plain: list[int] | None = None) -> tuple[list[int], list[Key]]:
        """Slots for a read's misses (``sizes`` bytes each: the files), each block offered to the cache at its
        ``plain`` image size (what it holds once a sealed file is opened; default ``sizes``): admitted, or
        refused by the filter and placed in the bypass room. Returns (offsets, evicted keys). Raises
        QuotaExceededError when the request is larger than the budget or the tenant's share, or pins and
        in-use blocks leave no room; nothing stays reserved then."""
        aligned = [align_up(s) for s in sizes]
        counted = aligned if plain is None else [align_up(s) for s in plain]
        with self.lock:
            self._drain()
            # Blocks of the same request already resident stay: count them, and fail before evicting anything.
            held = [align_up(self._entries[k].size) for k in protect if k in self._entries and k not in keys]
            total, share = sum(counted) + sum(held), self.cache.share(tenant)
            if total > self.cache.budget_bytes:
                raise QuotaExceededError(f"{len(sizes) + len(held)} blocks need {total} bytes, more than the DRAM "
                                         f"budget ({self.cache.budget_bytes})")
            if share is not None and total > share:
                raise QuotaExceededError(f"{len(sizes) + len(held)} blocks need {total} bytes, more than tenant "
                                         f"{tenant!r}'s quota ({share})")
            for k in protect:  # a request's blocks never evict each other
                self.cache.pin(k)
            offsets: list[int] = []
            evicted: list[Key] = []
            try:
                for k, a, c in zip(keys, aligned, counted):
                    offsets.append(self._place(tenant, k, a, evicted, bypass=True, counted=c))
            except BaseException:
                self._abort_locked(offsets, aligned)
                raise
            finally:
                for k in protect:
                    self.cache.unpin(k)
            return offsets, evicted

    def offer(self, tenant: str, key: Key, size: int) -> int | None:
        """A slot for a block being stored or warmed up, when the cache admits it (free room, or colder blocks
        to push out); None otherwise (it stays on disk and loads on demand)."""
        with self.lock:
            self._drain()
            try:
                return self._place(tenant, key, align_up(size), [], bypass=False)
            except QuotaExceededError:
                return None

    def _place(self, tenant: str, key: Key, size: int, evicted: list[Key], *, bypass: bool,
               counted: int | None = None) -> int | None:
        adm = self.cache.admit(key, tenant, size if counted is None else counted)
        for v in adm.evicted:
            self._evict(v, evicted)
        if adm.admitted:
            self.cache.pin(key)  # until commit or abort
            off = self._alloc([size], evicted)
            if off is None:
                self.cache.unpin(key)
                self.cache.discard(key)
                raise QuotaExceededError(f"DRAM budget ({self.cache.budget_bytes} bytes) is held by pinned or "
                                         f"in-use blocks; {size} bytes needed")
            self._pending[off[0]] = key
            return off[0]
        if adm.reason == "share":
            raise QuotaExceededError(f"tenant {tenant!r} DRAM quota ({self.cache.share(tenant)} bytes) is held by "
                                     "pinned or in-use blocks")
        if adm.reason != "filter":
            raise QuotaExceededError(f"DRAM budget ({self.cache.budget_bytes} bytes) is held by pinned or in-use "
                                     f"blocks; {size} bytes needed")
        if not bypass:
            return None
        off, self._next_private = self._next_private, self._next_private - 1
        self._private[off] = np.empty(size, dtype=np.uint8)
        self._bypass.add(off)
        self.bypassed += 1
        return off

    def reserve(self, tenant: str, sizes: list[int]) -> tuple[list[int], list[Key]]:
        """Room for a transfer's ``sizes`` bytes (a peer pull writes into them), contiguous when possible (one
        transfer range), pushing out LRU blocks as needed; each block is offered to the cache at ``commit``.
        Returns (offsets, evicted keys). QuotaExceededError when pins and in-use blocks leave no room."""
        aligned = [align_up(s) for s in sizes]
        with self.lock:
            self._drain()
            if sum(aligned) > self.cache.budget_bytes:
                raise QuotaExceededError(f"{len(sizes)} blocks need {sum(aligned)} bytes, more than the DRAM budget "
                                         f"({self.cache.budget_bytes})")
            evicted: list[Key] = []
            offsets = self._alloc(aligned, evicted)
            if offsets is None:
                raise QuotaExceededError(f"DRAM budget ({self.cache.budget_bytes} bytes) is held by pinned or "
                                         f"in-use blocks; {sum(aligned)} bytes needed for tenant {tenant!r}")
            return offsets, evicted

    def _alloc(self, aligned: list[int], evicted: list[Key]) -> list[int] | None:
        """Arena slots for ``aligned``; when the arena is full (bytes outside the cache's count: bypassed and
        reserved slots, entries still read after eviction, fragmentation), the LRU unpinned block goes."""
        while True:
            offsets = self._try_alloc(aligned)
            if offsets is not None:
                return offsets
            key = self.cache.shed()
            if key is None:
                return None
            self._evict(key, evicted)

    def _try_alloc(self, aligned: list[int]) -> list[int] | None:
        alloc = self.arena.allocator
        start = alloc.alloc(sum(aligned))
        if start is not None:
            offsets, pos = [], start
            for a in aligned:
                offsets.append(pos)
                pos += a
            return offsets
        got: list[int] = []
        for a in aligned:  # fragmented: fall back to one slot per block
            off = alloc.alloc(a)
            if off is None:
                for o, s in zip(got, aligned):
                    alloc.free(o, s)
                return None
            got.append(off)
        return got

    def abort(self, tenant: str, offsets: list[int], sizes: list[int]) -> None:
        """Give back reserved slots that were never committed."""
        with self.lock:
            self._abort_locked(offsets, sizes)

    def _abort_locked(self, offsets: list[int], sizes: list[int]) -> None:
        for off, s in zip(offsets, sizes):
            key = self._pending.pop(off, None)
            if key is not None:
                self.cache.unpin(key)
                if key not in self._entries:
                    self.cache.discard(key)
            self._bypass.discard(off)
            if off < 0:
                self._private.pop(off, None)
            else:
                self.arena.allocator.free(off, s)

    def shrink(self, tenant: str, offset: int, reserved: int, keep: int) -> None:
        """Give back the tail of a reserved slot beyond ``keep`` bytes (a sealed file read into the slot was
        opened into a smaller plain image at its start). The cache keeps counting the file's size."""
        cut = align_up(keep)
        if cut >= align_up(reserved) or offset < 0:
            return
        with self.lock:
            self.arena.allocator.free(offset + cut, align_up(reserved) - cut)

    def generation(self, key: Key) -> int:
        return self._gen[key]

    def invalidate(self, key: Key) -> None:
        """The key's bytes changed (re-put, delete): drop the cached copy and fence off loads in flight."""
        with self.lock:
            self._drain()
            self._gen[key] += 1
            self._evict(key)
            self.cache.discard(key)

    def commit(self, key: Key, offset: int, size: int, info: BlobInfo, gen: int | None = None) -> DramEntry:
        """Make a filled slot resident; returns the entry with one reference held by the caller. The entry
        serves this caller only, and is freed on release, when the filter refused it, the cache does not take
        a transfer's block, or the key changed since ``gen`` was read."""
        e = DramEntry(key, offset, size, info, refs=1)
        with self.lock:
            self._drain()
            admitted = self._pending.pop(offset, None) == key  # its pin becomes the caller's reference
            if not admitted:
                self.cache.pin(key)
            if self._bypass_slot(offset) or (gen is not None and self._gen[key] != gen):
                e.dead = True
                if admitted and key not in self._entries:
                    self.cache.discard(key)
                return e
            if not admitted and not self._offer_transfer(key, size):
                e.dead = True
                return e
            if key not in self.cache:  # dropped while it loaded
                e.dead = True
                return e
            self.cache.shrink(key, align_up(size))
            old = self._entries.pop(key, None)
            if old is not None:  # a concurrent load or a re-put: the newest copy wins
                old.dead = True
                if old.refs == 0:
                    self._free(old)
            self._entries[key] = e
        return e

    def _bypass_slot(self, offset: int) -> bool:
        if offset not in self._bypass:
            return False
        self._bypass.discard(offset)
        return True

    def _offer_transfer(self, key: Key, size: int) -> bool:
        adm = self.cache.admit(key, key[0], align_up(size))
        for v in adm.evicted:
            self._evict(v)
        return adm.admitted

    def drop(self, pred: Callable[[Key], bool]) -> list[Key]:
        with self.lock:
            self._drain()
            evicted: list[Key] = []
            for k in [k for k in self._entries if pred(k)]:
                self._evict(k, evicted)
                self.cache.discard(k)
            return evicted

    def resident(self, key: Key) -> bool:
        return key in self._entries

    def set_share(self, tenant: str, nbytes: int | None) -> None:
        set_share(self.cache, tenant, nbytes)

    def set_pinned(self, keys: list[Key], on: bool) -> None:
        with self.lock:
            self._drain()
            self._pinned.set(keys, on)

    def stats(self) -> dict[str, int]:
        with self.lock:
            self._drain()
            c = self.cache.stats
            return {"dram_blocks": len(self._entries), "dram_bytes": self.cache.used_bytes,
                    "dram_budget": self.cache.budget_bytes, "dram_misses": c.misses, "dram_admitted": c.admitted,
                    "dram_rejected": c.rejected, "dram_evicted": c.evicted, "dram_bypassed": self.bypassed}

    def tenant_bytes(self, tenant: str) -> int:
        with self.lock:
            self._drain()
            return self.cache.tenant_bytes(tenant)
