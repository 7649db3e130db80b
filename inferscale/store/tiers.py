"""The two cache tiers above disk: DRAM (G2, an arena of blob images) and the device (G1, kv tensors on CUDA).

Both are LRU with a byte budget, an optional per-tenant quota (a tenant over its quota evicts its own blocks,
never another tenant's), and never evict pinned or in-use blocks. Eviction only drops the cached copy: the
disk tier (G3) always keeps the blob."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass
from typing import Callable

import torch

from inferscale.errors import QuotaExceededError
from inferscale.kvformat import KVBlock
from inferscale.store.arena import Arena, align_up
from inferscale.store.blob import BlobInfo

Key = tuple[str, str, str, str]  # tenant, user, fingerprint, item


@dataclass(eq=False)
class DramEntry:
    key: Key
    offset: int  # in the arena
    size: int  # blob bytes
    info: BlobInfo
    refs: int = 0  # readers (leased views, peer transfers); an entry with refs is never reused
    dead: bool = False  # evicted or replaced; its bytes are freed when refs reach 0


class DramTier:
    def __init__(self, arena: Arena, *, tenant_quota: int | None, is_pinned: Callable[[Key], bool]) -> None:
        self.arena = arena
        self.quota = tenant_quota  # the default DRAM share of a tenant; None = no per-tenant bound
        self.tenant_quotas: dict[str, int | None] = {}  # per-tenant overrides (the server's tenants file)
        self.is_pinned = is_pinned
        self.lock = threading.Lock()
        self._lru: OrderedDict[Key, DramEntry] = OrderedDict()
        self._tenant_bytes: dict[str, int] = defaultdict(int)
        # Bumped on every put/delete of a key: a load that raced with one must not cache the old bytes.
        self._gen: dict[Key, int] = defaultdict(int)
        # Releases from finalizers land here (lock-free) and are applied under the lock: a finalizer can run
        # in any thread at any time, including while this thread holds the lock.
        self._released: deque[DramEntry] = deque()

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def _drain(self) -> None:
        while self._released:
            e = self._released.popleft()
            e.refs -= 1
            if e.dead and e.refs == 0:
                self._free(e)

    def _free(self, e: DramEntry) -> None:
        self.arena.allocator.free(e.offset, e.size)
        self._tenant_bytes[e.key[0]] -= align_up(e.size)

    def _evict(self, e: DramEntry, evicted: list[Key]) -> None:
        del self._lru[e.key]
        e.dead = True
        if e.refs == 0:
            self._free(e)
        evicted.append(e.key)

    def _victim(self, tenant: str | None, protect: set[Key]) -> DramEntry | None:
        for key, e in self._lru.items():  # oldest first
            if (tenant is None or key[0] == tenant) and e.refs == 0 and key not in protect and not self.is_pinned(key):
                return e
        return None

    # -- reads ----------------------------------------------------------------------------------------------
    def acquire(self, key: Key) -> DramEntry | None:
        """The resident entry for ``key`` with one reference taken (release it, or hand it to lease_view)."""
        with self.lock:
            self._drain()
            e = self._lru.get(key)
            if e is not None:
                self._lru.move_to_end(key)
                e.refs += 1
            return e

    def release(self, e: DramEntry) -> None:
        self._released.append(e)
        if self.lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self.lock.release()

    def lease_view(self, e: DramEntry) -> torch.Tensor:
        """A uint8 tensor over the entry's bytes that owns the caller's reference: the slot cannot be reused
        while any tensor viewing it (kv views included) is alive. Zero-copy."""
        arr = self.arena.np_slice(e.offset, e.size)
        weakref.finalize(arr, self.release, e)
        return torch.from_numpy(arr)

    # -- writes ---------------------------------------------------------------------------------------------
    def reserve(self, tenant: str, sizes: list[int], protect: set[Key] = frozenset()) -> tuple[list[int], list[Key]]:
        """Room for ``sizes`` bytes, contiguous when possible (one transfer range per user), evicting LRU
        blocks as needed. Returns (offsets, evicted keys). Raises QuotaExceededError when pins, in-use blocks
        or the tenant's quota leave no room."""
        aligned = [align_up(s) for s in sizes]
        need = sum(aligned)
        with self.lock:
            self._drain()
            # Blocks of the same request already resident stay: count them, and fail before evicting anything.
            held = [align_up(self._lru[k].size) for k in protect if k in self._lru]
            total = need + sum(held)
            quota = self.tenant_quotas.get(tenant, self.quota)
            if total > self.arena.size:
                raise QuotaExceededError(f"{len(sizes) + len(held)} blocks need {total} bytes, more than the DRAM "
                                         f"budget ({self.arena.size})")
            if quota is not None and total > quota:
                raise QuotaExceededError(f"{len(sizes) + len(held)} blocks need {total} bytes, more than tenant "
                                         f"{tenant!r}'s quota ({quota})")
            evicted: list[Key] = []
            while quota is not None and self._tenant_bytes[tenant] + need > quota:
                v = self._victim(tenant, protect)
                if v is None:
                    raise QuotaExceededError(f"tenant {tenant!r} DRAM quota ({quota} bytes) is held by pinned "
                                             "or in-use blocks")
                self._evict(v, evicted)
            while True:
                offsets = self._try_alloc(aligned)
                if offsets is not None:
                    self._tenant_bytes[tenant] += need
                    return offsets, evicted
                v = self._victim(None, protect)
                if v is None:
                    raise QuotaExceededError(f"DRAM budget ({self.arena.size} bytes) is held by pinned or in-use "
                                             f"blocks; {need} bytes needed")
                self._evict(v, evicted)

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
            for off, s in zip(offsets, sizes):
                self.arena.allocator.free(off, s)
                self._tenant_bytes[tenant] -= align_up(s)

    def shrink(self, tenant: str, offset: int, reserved: int, keep: int) -> None:
        """Give back the tail of a reserved slot beyond ``keep`` bytes (a sealed file read into the slot was
        opened into a smaller plain image at its start)."""
        cut = align_up(keep)
        if cut >= align_up(reserved):
            return
        with self.lock:
            self.arena.allocator.free(offset + cut, align_up(reserved) - cut)
            self._tenant_bytes[tenant] -= align_up(reserved) - cut

    def generation(self, key: Key) -> int:
        return self._gen[key]

    def invalidate(self, key: Key) -> None:
        """The key's bytes changed (re-put, delete): drop the cached copy and fence off loads in flight."""
        with self.lock:
            self._drain()
            self._gen[key] += 1
            e = self._lru.get(key)
            if e is not None:
                self._evict(e, [])

    def commit(self, key: Key, offset: int, size: int, info: BlobInfo, gen: int | None = None) -> DramEntry:
        """Make a filled slot resident; returns the entry with one reference held by the caller. When the key
        changed since ``gen`` was read, the entry serves this caller only and is freed on release."""
        e = DramEntry(key, offset, size, info, refs=1)
        with self.lock:
            self._drain()
            if gen is not None and self._gen[key] != gen:
                e.dead = True
                return e
            old = self._lru.pop(key, None)
            if old is not None:  # a concurrent load or a re-put: the newest copy wins
                old.dead = True
                if old.refs == 0:
                    self._free(old)
            self._lru[key] = e
        return e

    def drop(self, pred: Callable[[Key], bool]) -> list[Key]:
        with self.lock:
            self._drain()
            evicted: list[Key] = []
            for e in [e for k, e in self._lru.items() if pred(k)]:
                self._evict(e, evicted)
            return evicted

    def resident(self, key: Key) -> bool:
        return key in self._lru

    def stats(self) -> dict[str, int]:
        with self.lock:
            self._drain()
            return {"dram_blocks": len(self._lru), "dram_bytes": self.arena.allocator.used,
                    "dram_budget": self.arena.size}

    def tenant_bytes(self, tenant: str) -> int:
        with self.lock:
            self._drain()
            return self._tenant_bytes[tenant]


class DeviceTier:
    """G1: kv tensors on the accelerator, LRU with a byte budget and per-tenant quota. Blocks handed out share
    the cached tensor (the engine only reads them); an evicted tensor lives on until its last reader drops it."""

    def __init__(self, budget: int, *, tenant_quota: int | None, device: torch.device,
                 is_pinned: Callable[[Key], bool]) -> None:
        self.budget, self.quota, self.device, self.is_pinned = budget, tenant_quota, device, is_pinned
        self.lock = threading.Lock()
        self._lru: OrderedDict[Key, KVBlock] = OrderedDict()
        self._tenant_bytes: dict[str, int] = defaultdict(int)
        self.used = 0

    def get(self, key: Key) -> KVBlock | None:
        with self.lock:
            hit = self._lru.get(key)
            if hit is None:
                return None
            self._lru.move_to_end(key)
            return dataclasses.replace(hit)

    def resident(self, key: Key) -> bool:
        return key in self._lru

    def _remove(self, key: Key) -> None:
        n = self._lru.pop(key).nbytes
        self.used -= n
        self._tenant_bytes[key[0]] -= n

    def _evict_one(self, tenant: str | None, protect: set[Key], evicted: list[Key]) -> bool:
        for key in self._lru:
            if (tenant is None or key[0] == tenant) and key not in protect and not self.is_pinned(key):
                self._remove(key)
                evicted.append(key)
                return True
        return False

    def put(self, key: Key, block: KVBlock, protect: set[Key], cache: bool = True) -> tuple[KVBlock, list[Key]]:
        """Copy the block's kv up to the device and cache it when budget and quota allow; returns the block on
        the device (cached or not) and the keys evicted to make room."""
        n = block.nbytes
        # Synchronous copy: the DRAM slot it comes from may be reused once the caller drops its view.
        scale = None if block.kv_scale is None else block.kv_scale.to(self.device)  # compact blocks travel compact
        dev = dataclasses.replace(block, kv=block.kv.to(self.device), kv_scale=scale)
        evicted: list[Key] = []
        with self.lock:
            if not cache or n > self.budget or (self.quota is not None and n > self.quota):
                return dev, evicted
            if key in self._lru:
                self._remove(key)
            while self.quota is not None and self._tenant_bytes[key[0]] + n > self.quota:
                if not self._evict_one(key[0], protect, evicted):
                    return dev, evicted
            while self.used + n > self.budget:
                if not self._evict_one(None, protect, evicted):
                    return dev, evicted
            self._lru[key] = dev
            self.used += n
            self._tenant_bytes[key[0]] += n
        return dataclasses.replace(dev), evicted

    def drop(self, pred: Callable[[Key], bool]) -> list[Key]:
        with self.lock:
            gone = [k for k in self._lru if pred(k)]
            for k in gone:
                self._remove(k)
            return gone

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"gpu_blocks": len(self._lru), "gpu_bytes": self.used, "gpu_budget": self.budget}
