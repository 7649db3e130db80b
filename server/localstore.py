"""A minimal single-node store with the Store API's shape (docs/interfaces.md), used when ``inferscale.store``
has no ``KVStore``: blobs on disk under ``root/<tenant>/<user>/<id>.safetensors`` and an LRU of decoded blocks in
DRAM bounded by ``dram_budget_bytes``. No GPU tier, no peers."""

from __future__ import annotations

import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inferscale.errors import BlobCorruptError, NotFoundError, QuotaExceededError, TransferError
from inferscale.kvformat import KVBlock, blob_path, list_blobs, load_block, save_block


@dataclass
class ItemInfo:
    id: str
    text: str
    timestamp: str | None
    tokens: int
    bytes: int
    tier: str


@dataclass
class FetchStats:
    tiers: dict[str, int] = field(default_factory=dict)  # tier -> blocks served from it
    bytes: int = 0
    seconds: float = 0.0


class LocalStore:
    def __init__(self, root: Path, *, dram_budget_bytes: int, gpu_budget_bytes: int = 0,
                 tenant_quota_bytes: int | None = None, node: str = "", nixl: bool = False) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.dram_budget_bytes = dram_budget_bytes
        self.tenant_quota_bytes = tenant_quota_bytes
        self.node = node
        self._dram: OrderedDict[tuple[str, str, str], KVBlock] = OrderedDict()
        self._dram_bytes = 0
        self._emb: dict[tuple[str, str], tuple[list[str], torch.Tensor]] = {}
        self._lock = threading.RLock()

    # ---- paths --------------------------------------------------------------------------------------------
    def _dir(self, tenant: str, user: str) -> Path:
        return self.root / tenant / user

    def _user_dir(self, tenant: str, user: str) -> Path:
        d = self._dir(tenant, user)
        if not d.is_dir() or not list_blobs(d):
            raise NotFoundError(f"user {user!r} not found")
        return d

    # ---- DRAM tier ----------------------------------------------------------------------------------------
    def _cache(self, key: tuple[str, str, str], block: KVBlock) -> None:
        if block.nbytes > self.dram_budget_bytes:
            return
        old = self._dram.pop(key, None)
        if old is not None:
            self._dram_bytes -= old.nbytes
        self._dram[key] = block
        self._dram_bytes += block.nbytes
        while self._dram_bytes > self.dram_budget_bytes:
            _, evicted = self._dram.popitem(last=False)
            self._dram_bytes -= evicted.nbytes

    def _drop(self, tenant: str, user: str, item_id: str | None) -> None:
        for key in [k for k in self._dram if k[:2] == (tenant, user) and (item_id is None or k[2] == item_id)]:
            self._dram_bytes -= self._dram.pop(key).nbytes
        self._emb.pop((tenant, user), None)

    # ---- the Store API ------------------------------------------------------------------------------------
    def put(self, tenant: str, user: str, block: KVBlock) -> None:
        with self._lock:
            if self.tenant_quota_bytes is not None and self._tenant_bytes(tenant) + block.nbytes > self.tenant_quota_bytes:
                raise QuotaExceededError(f"tenant {tenant!r}: over its quota of {self.tenant_quota_bytes} bytes")
            save_block(block, self._dir(tenant, user))
            self._drop(tenant, user, block.item_id)
            self._cache((tenant, user, block.item_id), block)

    def get_many(self, tenant: str, user: str, item_ids: list[str], fingerprint: str) -> tuple[list[KVBlock], FetchStats]:
        t0 = time.perf_counter()
        stats = FetchStats()
        blocks = []
        with self._lock:
            d = self._user_dir(tenant, user)
            for item_id in item_ids:
                key = (tenant, user, item_id)
                block = self._dram.get(key)
                tier = "dram"
                if block is None:
                    path = blob_path(d, item_id)
                    if not path.exists():
                        raise NotFoundError(f"memory {item_id!r} of user {user!r} not found")
                    block = load_block(path, expect_fingerprint=fingerprint)
                    tier = "disk"
                    self._cache(key, block)
                else:
                    self._dram.move_to_end(key)
                blocks.append(block)
                stats.tiers[tier] = stats.tiers.get(tier, 0) + 1
                stats.bytes += block.nbytes
        stats.seconds = time.perf_counter() - t0
        return blocks, stats

    def delete(self, tenant: str, user: str, item_id: str | None = None) -> int:
        with self._lock:
            d = self._dir(tenant, user)
            self._drop(tenant, user, item_id)
            if item_id is None:
                n = len(list_blobs(d)) if d.is_dir() else 0
                shutil.rmtree(d, ignore_errors=True)
                return n
            path = blob_path(d, item_id)
            if not path.exists():
                return 0
            path.unlink()
            return 1

    def list(self, tenant: str, user: str) -> list[ItemInfo]:
        with self._lock:
            d = self._user_dir(tenant, user)
            out = []
            for path in list_blobs(d):
                key = (tenant, user, path.stem)
                block = self._dram.get(key) or load_block(path)
                out.append(ItemInfo(block.item_id, block.text, block.timestamp, block.num_tokens, block.nbytes,
                                    "dram" if key in self._dram else "disk"))
            return out

    def users(self, tenant: str) -> list[str]:
        d = self.root / tenant
        return sorted(p.name for p in d.iterdir() if p.is_dir() and list_blobs(p)) if d.is_dir() else []

    def embeddings(self, tenant: str, user: str, fingerprint: str) -> tuple[list[str], torch.Tensor]:
        with self._lock:
            cached = self._emb.get((tenant, user))
            if cached is not None:
                return cached
            d = self._user_dir(tenant, user)
            ids, rows = [], []
            for path in list_blobs(d):
                key = (tenant, user, path.stem)
                block = self._dram.get(key)
                if block is None:
                    block = load_block(path, expect_fingerprint=fingerprint)
                    self._cache(key, block)
                if block.embedding is not None:
                    ids.append(block.item_id)
                    rows.append(block.embedding.to(torch.float32))
            out = (ids, torch.stack(rows) if rows else torch.zeros((0, 384)))
            self._emb[(tenant, user)] = out
            return out

    def import_dir(self, tenant: str, user: str, directory: Path, item_ids: list[str] | None = None) -> int:
        paths = list_blobs(Path(directory))
        if item_ids is not None:
            wanted = set(item_ids)
            paths = [p for p in paths if p.stem in wanted]
        n = 0
        for path in paths:
            try:
                self.put(tenant, user, load_block(path))
                n += 1
            except BlobCorruptError:
                continue
        return n

    def pull_from_peer(self, tenant: str, user: str, peer: str, item_ids: list[str] | None) -> int:
        raise TransferError(f"peer pulls need the tiered store (inferscale.store); cannot pull from {peer}")

    def pin(self, tenant: str, user: str) -> None:
        pass

    def unpin(self, tenant: str, user: str) -> None:
        pass

    def _tenant_bytes(self, tenant: str) -> int:
        d = self.root / tenant
        return sum(p.stat().st_size for p in d.rglob("*.safetensors")) if d.is_dir() else 0

    def stats(self) -> dict:
        with self._lock:
            disk = sum(p.stat().st_size for p in self.root.rglob("*.safetensors"))
            users = sum(1 for t in self.root.iterdir() if t.is_dir() for u in t.iterdir() if u.is_dir())
            return {"dram_bytes": self._dram_bytes, "dram_budget_bytes": self.dram_budget_bytes, "disk_bytes": disk,
                    "users": users}
