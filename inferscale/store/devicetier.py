"""G1, the device tier: kv tensors on the accelerator, cached per block by a ``BlockCache`` (the same policy as
DRAM: frequency-filtered admission, LRU eviction, byte budget, tenant shares, pins). Blocks handed out share the
cached tensor (the engine only reads them); an evicted tensor lives on until its last reader drops it."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import torch

from inferscale.kvformat import KVBlock
from inferscale.store.blockcache import BlockCache
from inferscale.store.tier import Key, PinnedKeys, TransferMeter, set_share


class DeviceTier:
    """The ``CacheTier`` of the device (``store.tier``)."""

    name = "gpu"

    def __init__(self, device: torch.device, cache: BlockCache) -> None:
        self.device, self.cache = device, cache
        self.transfers = TransferMeter(self.name)
        self.lock = threading.Lock()
        self._blocks: dict[Key, KVBlock] = {}
        self._pinned = PinnedKeys(cache)

    def get(self, key: Key, size: int = 0) -> KVBlock | None:
        """The cached block (a shallow copy sharing the device tensor), or None; a read either way."""
        with self.lock:
            hit = self._blocks.get(key)
            self.cache.lookup(key, hit.nbytes if hit is not None else size)
            return None if hit is None else dataclasses.replace(hit)

    def put(self, key: Key, block: KVBlock, protect: set[Key], cache: bool = True) -> tuple[KVBlock, list[Key]]:
        """Copy the block's kv up to the device and offer it to the cache (``cache``); returns the block on the
        device (cached or not) and the keys evicted to make room. ``protect``: the request's other blocks."""
        # Synchronous copy: the DRAM slot it comes from may be reused once the caller drops its view.
        scale = None if block.kv_scale is None else block.kv_scale.to(self.device)  # compact blocks travel compact
        dev = dataclasses.replace(block, kv=block.kv.to(self.device), kv_scale=scale)
        if not cache:
            return dev, []
        with self.lock:
            if key in self._blocks:
                self.cache.discard(key)
                del self._blocks[key]
            for k in protect:
                self.cache.pin(k)
            try:
                adm = self.cache.admit(key, key[0], block.nbytes)
            finally:
                for k in protect:
                    self.cache.unpin(k)
            for v in adm.evicted:
                self._blocks.pop(v, None)
            if adm.admitted:
                self._blocks[key] = dev
        return dataclasses.replace(dev), list(adm.evicted)

    def resident(self, key: Key) -> bool:
        return key in self._blocks

    def drop(self, pred: Callable[[Key], bool]) -> list[Key]:
        with self.lock:
            gone = [k for k in self._blocks if pred(k)]
            for k in gone:
                del self._blocks[k]
                self.cache.discard(k)
            return gone

    def set_share(self, tenant: str, nbytes: int | None) -> None:
        set_share(self.cache, tenant, nbytes)

    def set_pinned(self, keys: list[Key], on: bool) -> None:
        with self.lock:
            self._pinned.set(keys, on)

    def tenant_bytes(self, tenant: str) -> int:
        with self.lock:
            return self.cache.tenant_bytes(tenant)

    def stats(self) -> dict[str, int]:
        with self.lock:
            c = self.cache.stats
            return {"gpu_blocks": len(self._blocks), "gpu_bytes": self.cache.used_bytes,
                    "gpu_budget": self.cache.budget_bytes, "gpu_misses": c.misses, "gpu_admitted": c.admitted,
                    "gpu_rejected": c.rejected, "gpu_evicted": c.evicted}
