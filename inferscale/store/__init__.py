"""Tiered, tenant-scoped store of memory KV blocks (G1 device, G2 DRAM, G3 disk, G4 peers via NIXL)."""

from inferscale.store.catalogue import ItemInfo
from inferscale.store.store import FetchStats, KVStore, PullResult

__all__ = ["FetchStats", "ItemInfo", "KVStore", "PullResult"]
