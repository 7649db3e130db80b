"""KVStore: the tiered, tenant-scoped store of memory KV blocks on one node.

Tiers, fastest first: G1 device (CUDA, optional), G2 DRAM arena, G3 local disk (safetensors blobs, the source
of truth), G4 peers (other nodes' DRAM via NIXL UCX, one lease at a time: pulling.py, serving.py). Every call
names the tenant and every lookup is keyed by (tenant, user, fingerprint, item): there is no path from one
tenant's name to another's bytes, and identical content in two tenants is stored twice on purpose (no
cross-tenant dedup).

With a ``keyring`` (the server always passes one) every blob on disk is sealed for its (tenant, user, item,
fingerprint) (``inferscale.sealing``) and opened, authenticated, on its way up into DRAM; DRAM and GPU hold plain
images. Without one the disk holds plain images checked by sha256 only (library and bench use)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from inferscale import sealing
from inferscale.errors import (
    BlobCorruptError, ConfigError, FingerprintMismatchError, NotFoundError, QuotaExceededError,
)
from inferscale.kvformat import KVBlock, encode_blob
from inferscale.store.arena import Arena
from inferscale.store.blob import BlobInfo, block_from_image, parse_header, remove_orphan_temps
from inferscale.store.catalogue import Catalogue, ItemInfo
from inferscale.store.diskload import load_from_disk
from inferscale.store.jobdir import read_job_dir
from inferscale.store.disktier import DiskTier, item_info
from inferscale.store.layout import CATALOGUE_NAME, check_fingerprint, check_name, item_path
from inferscale.store.results import FetchStats, PullResult
from inferscale.store.tiers import DeviceTier, DramEntry, DramTier, Key

log = logging.getLogger(__name__)
DEFAULT_MIN_BLOCK = 64 << 10  # budgets below this cannot hold any real block; the server passes its model's size


class KVStore:
    def __init__(
        self,
        root: str | os.PathLike,
        *,
        dram_budget_bytes: int,
        gpu_budget_bytes: int = 0,
        tenant_quota_bytes: int | None = None,
        node: str | None = None,
        nixl: bool = True,
        peer_port: int | None = None,
        peer_host: str = "0.0.0.0",
        peer_secret: str | None = None,
        timeout_s: float = 10.0,
        device: str | torch.device | None = None,
        min_block_bytes: int = DEFAULT_MIN_BLOCK,
        keyring: sealing.Keyring | None = None,
        job_root: str | os.PathLike | None = None,
        ucx_port_range: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.keyring = keyring
        # The node's KV host path: the only place a peer may ask this store to import a Job's output from.
        self.job_root = None if job_root is None else Path(job_root)
        self.node = node or socket.gethostname()
        self.timeout_s = timeout_s
        self.peer_secret = peer_secret  # INFERSCALE_PEER_SECRET: MACs peer requests, never sent
        for name, v in (("dram_budget_bytes", dram_budget_bytes), ("gpu_budget_bytes", gpu_budget_bytes)):
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {v!r}")
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise ConfigError(f"store root {self.root} is not usable: {e.strerror or e}") from None
        orphans = remove_orphan_temps(self.root)  # writes a crash cut short; the blobs they replaced are intact
        if orphans:
            log.warning("removed %d orphan temp files under %s", orphans, self.root)
        self._write_lock = threading.Lock()  # disk + catalogue changes of puts and deletes
        self.catalogue = Catalogue(self.root / CATALOGUE_NAME)
        self.disk = DiskTier(self.root, self.catalogue, keyring, self._write_lock)
        if self.catalogue.fresh:
            self.rebuild()
        # A budget that cannot hold one block would make every request fail: refuse it at start.
        floor = max(min_block_bytes, self.catalogue.max_size())
        for name, v in (("DRAM budget", dram_budget_bytes), ("GPU budget", gpu_budget_bytes or None),
                        ("tenant quota", tenant_quota_bytes)):
            if v is not None and v < floor:
                raise ConfigError(f"{name} of {v} bytes is smaller than one block ({floor} bytes)")
        self._pins: set[Key] = self.catalogue.pinned_keys()
        is_pinned = self._pins.__contains__

        self.gpu: DeviceTier | None = None
        if gpu_budget_bytes:
            dev = torch.device(device) if device is not None else torch.device("cuda")
            if dev.type == "cuda" and torch.cuda.is_available():
                self.gpu = DeviceTier(gpu_budget_bytes, tenant_quota=tenant_quota_bytes, device=dev,
                                      is_pinned=is_pinned)
            else:
                log.warning("GPU budget set but %s is unavailable: device tier disabled", dev)
        self.arena = Arena(dram_budget_bytes, pin=self.gpu is not None)
        self.dram = DramTier(self.arena, tenant_quota=tenant_quota_bytes, is_pinned=is_pinned)
        self.transport = None
        if nixl:
            from inferscale.store.nixl_transport import NixlTransport

            self.transport = NixlTransport(self.arena, name=f"{self.node}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                                           timeout_s=timeout_s, ucx_port_range=ucx_port_range)
        self.hasher = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                          thread_name_prefix="kvstore-verify")
        self.counters = {"gpu_hits": 0, "dram_hits": 0, "disk_reads": 0, "peer_pulls": 0, "corrupt": 0}
        self.peer_service = None
        if peer_port is not None:
            from inferscale.store.serving import PeerService

            if peer_secret is None:
                raise ConfigError("serving peers (peer_port) needs a peer secret (INFERSCALE_PEER_SECRET)")
            self.peer_service = PeerService(self, peer_host, peer_port, secret=peer_secret, timeout_s=timeout_s)

    # -- lifecycle ------------------------------------------------------------------------------------------
    @property
    def peer_address(self) -> str | None:
        return None if self.peer_service is None else f"{self.node}:{self.peer_service.port}"

    def close(self) -> None:
        if self.peer_service is not None:
            self.peer_service.close()
        self.hasher.shutdown(wait=True)
        if self.transport is not None:
            self.transport.close()
        self.catalogue.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rebuild(self) -> int:
        """Re-catalogue every blob in the disk tier (after the catalogue was lost); see DiskTier.rebuild."""
        return self.disk.rebuild()

    def rotate_keys(self) -> int:
        """Re-wrap every sealed blob's data key and re-MAC every catalogue row under the keyring's current KEK
        line; afterwards older KEK lines can be dropped. Returns blobs rewritten."""
        if self.keyring is None:
            raise ConfigError("this store has no KEK: nothing to rotate")
        return self.disk.rotate_keys()

    # -- public API -----------------------------------------------------------------------------------------
    def put(self, tenant: str, user: str, block: KVBlock, *, cache: bool = True) -> ItemInfo:
        """Store a block on disk (atomically) and, when it fits, in DRAM. Replaces an item of the same key."""
        check_name("tenant", tenant), check_name("user", user), check_name("item", block.item_id)
        check_fingerprint(block.model_fingerprint)
        data = encode_blob(block)
        info = parse_header(data, source=block.item_id, total=len(data))
        return self.store_image(tenant, user, memoryview(data), info, cache=cache)

    def get_many(self, tenant: str, user: str, item_ids: list[str], fingerprint: str, *,
                 copy: bool = False) -> tuple[list[KVBlock], FetchStats]:
        """The blocks of ``item_ids`` (in that order) from the fastest tier holding each, promoting them.

        kv tensors served from DRAM are zero-copy, read-only views of the arena, valid for as long as the caller
        holds them (the slot is not reused meanwhile); ``copy=True`` returns owned tensors instead."""
        t0 = time.perf_counter()
        rows = list({r.key: r for r in self._rows(tenant, user, fingerprint, list(item_ids))}.values())
        keys = [r.key for r in rows]  # unique; duplicates in item_ids share a block
        protect = set(keys)
        stats = FetchStats()
        out: dict[Key, KVBlock] = {}
        if self.gpu is not None:
            for k in keys:
                b = self.gpu.get(k)
                if b is not None:
                    out[k] = b
                    stats.served[k[3]] = "gpu"
        rest = [r for r in rows if r.key not in out]
        entries, loaded, _ = self.ensure_dram(tenant, rest, protect)
        from_disk = {e.key for e in loaded}
        for r in rest:
            e = entries[r.key]
            b = block_from_image(self.dram.lease_view(e), e.info)
            if copy:
                b.kv = b.kv.clone()
                b.kv_scale = None if b.kv_scale is None else b.kv_scale.clone()
            if self.gpu is not None:
                b, _ = self.gpu.put(r.key, b, protect, cache=not e.dead)
            out[r.key] = b
            stats.served[r.item_id] = "disk" if r.key in from_disk else "dram"
            if r.key in from_disk:
                stats.bytes_read += e.size
        by_item = {k[3]: out[k] for k in keys}
        blocks = [by_item[i] for i in item_ids]
        for tier in stats.served.values():
            stats.tiers[tier] += 1
        stats.bytes = sum(b.nbytes for b in blocks)
        self.counters["gpu_hits"] += stats.tiers["gpu"]
        self.counters["dram_hits"] += stats.tiers["dram"]
        self.counters["disk_reads"] += stats.tiers["disk"]
        stats.seconds = time.perf_counter() - t0
        return blocks, stats

    def delete(self, tenant: str, user: str, item_id: str | None = None, *, fingerprint: str | None = None) -> int:
        """Remove an item (every fingerprint of it) or all of a user's items from every tier. Returns blocks
        removed; NotFoundError when there was nothing to remove."""
        n, _ = self._remove(tenant, user, None if item_id is None else [item_id], fingerprint)
        if n == 0:
            what = f"item {item_id!r}" if item_id is not None else "memories"
            raise NotFoundError(f"{what} not found for tenant {tenant!r} user {user!r}")
        return n

    def purge(self, tenant: str, user: str, item_ids: list[str] | None = None) -> tuple[int, int]:
        """Idempotent delete for the internal purge endpoint: (removed blocks, removed bytes), zeros if absent."""
        return self._remove(tenant, user, item_ids, None)

    def list(self, tenant: str, user: str) -> list[ItemInfo]:
        check_name("tenant", tenant), check_name("user", user)
        rows = self.catalogue.items(tenant, user)
        if not rows:
            raise NotFoundError(f"user {user!r} of tenant {tenant!r} has no memories on this node")
        for r in rows:  # residency from the tiers themselves, never stale
            r.tiers = ([*(["gpu"] if self.gpu is not None and self.gpu.resident(r.key) else []),
                        *(["dram"] if self.dram.resident(r.key) else []), "disk"])
        return rows

    def reorder(self, tenant: str, user: str, fingerprint: str, item_ids: list[str]) -> None:
        """Make ``item_ids`` (of this model) the user's list order, after every item stored before now."""
        check_name("tenant", tenant), check_name("user", user), check_fingerprint(fingerprint)
        with self._write_lock:
            self.catalogue.set_order(tenant, user, fingerprint, [check_name("item", i) for i in item_ids], time.time())

    def usage(self, tenant: str) -> tuple[int, int]:  # (items, bytes on disk) of the tenant, every user and model
        return self.catalogue.usage(tenant)

    def set_tenant_quota(self, tenant: str, dram_bytes: int | None) -> None:  # None: tenant_quota_bytes
        self.dram.tenant_quotas[tenant] = dram_bytes if dram_bytes is not None else self.dram.quota

    def users(self, tenant: str) -> list[str]:
        check_name("tenant", tenant)
        users = self.catalogue.users(tenant)
        if not users:
            raise NotFoundError(f"tenant {tenant!r} has no memories on this node")
        return users

    def embeddings(self, tenant: str, user: str, fingerprint: str) -> tuple[list[str], torch.Tensor]:
        """(item ids, [n, dim] float32) of the user's items encoded with an embedding, one catalogue query."""
        check_name("tenant", tenant), check_name("user", user), check_fingerprint(fingerprint)
        rows = self.catalogue.embeddings(tenant, user, fingerprint)
        if not rows and not self.catalogue.items(tenant, user):
            raise NotFoundError(f"user {user!r} of tenant {tenant!r} has no memories on this node")
        if not rows:
            return [], torch.empty(0, 0, dtype=torch.float32)
        return [r[0] for r in rows], self.disk.embedding_matrix(rows, tenant, user, fingerprint)

    def pin(self, tenant: str, user: str, item_ids: list[str] | None = None) -> int:
        """Keep these items resident once loaded (never evicted). Returns items pinned."""
        return self._set_pin(tenant, user, item_ids, True)

    def unpin(self, tenant: str, user: str, item_ids: list[str] | None = None) -> int:
        return self._set_pin(tenant, user, item_ids, False)

    def import_dir(self, tenant: str, user: str, directory: str | os.PathLike, items: list[str] | None = None,
                   *, load: bool = True) -> PullResult:
        """Adopt an encoding Job's output (``DIR/<id><SUFFIX>``): open (authenticate) each blob, store it in the
        disk tier and, with ``load``, in DRAM. Every blob is checked before any is stored; nothing is read through a
        symlink (inferscale/store/jobdir.py)."""
        t0 = time.perf_counter()
        return self.import_images(tenant, user, read_job_dir(tenant, user, directory, items, self.keyring), t0,
                                  load=load)

    def import_images(self, tenant: str, user: str, images: list[tuple[memoryview, BlobInfo]], t0: float, *,
                      load: bool = True) -> PullResult:
        """Store a Job's verified blobs (read from its dir, or delivered: store/ingest.py) as current versions."""
        tier, nbytes = ("dram" if load else "disk"), 0
        for data, info in images:
            self.store_image(tenant, user, data, info, cache=load)
            nbytes += len(data)
            if load and not self.dram.resident((tenant, user, info.fingerprint, info.item_id)):
                tier = "disk"
        return self.pull_result(tenant, user, len(images), nbytes, tier, t0)

    def pull_from_peer(self, tenant: str, user: str, peer: str, item_ids: list[str] | None = None,
                       fingerprint: str | None = None, *, source_dir: str | None = None) -> PullResult:
        """Copy a user's blocks from a peer node (NIXL UCX READ of a lease, one request) into this node's DRAM
        and disk, verifying every checksum (inferscale/store/pulling.py). TransferError when the peer is
        unreachable or too slow. ``source_dir``: an encoding Job's output directory on the peer's node
        (``<its kv host path>/<tenant>/<user>``); the peer imports missing items from it before serving them."""
        from inferscale.store.pulling import pull_from_peer

        return pull_from_peer(self, tenant, user, peer, item_ids, fingerprint, source_dir)

    def pull_result(self, tenant: str, user: str, blocks: int, nbytes: int, tier: str, t0: float) -> PullResult:
        rows = self.catalogue.items(tenant, user)
        return PullResult(tenant, user, blocks, nbytes, tier, time.perf_counter() - t0, len(rows),
                          sum(r.size for r in rows), sum(r.tokens for r in rows))

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = {"node": self.node, **self.catalogue.totals(), **self.dram.stats(), **self.counters}
        s.update(self.gpu.stats() if self.gpu is not None else {"gpu_blocks": 0, "gpu_bytes": 0, "gpu_budget": 0})
        s["bytes_used"], s["bytes_capacity"] = s["dram_bytes"], s["dram_budget"]
        s["nixl_backends"] = [] if self.transport is None else list(self.transport.backends)
        s["peer"] = self.peer_address
        return s

    # -- internals ------------------------------------------------------------------------------------------
    def store_image(self, tenant: str, user: str, image: memoryview, info: BlobInfo, *, cache: bool) -> ItemInfo:
        check_name("item", info.item_id)
        check_fingerprint(info.fingerprint)
        key = (tenant, user, info.fingerprint, info.item_id)
        item, emb = self._row(tenant, user, image, info)
        self.disk.write(item, image, emb, lambda: self._invalidate(key))
        with self._write_lock:
            gen = self.dram.generation(key)
        if cache:
            try:
                (off,), _ = self.dram.reserve(tenant, [len(image)], {key})
            except QuotaExceededError:
                return item  # does not fit now; it is on disk and loads on demand
            self.arena.np[off : off + len(image)] = memoryview(image).cast("B")
            self.dram.release(self.dram.commit(key, off, len(image), info, gen))
        return item

    def _rows(self, tenant: str, user: str, fingerprint: str, item_ids: list[str]) -> list[ItemInfo]:
        check_name("tenant", tenant), check_name("user", user), check_fingerprint(fingerprint)
        for i in item_ids:
            check_name("item", i)
        found = {r.item_id: r for r in self.catalogue.items(tenant, user, fingerprint, list(set(item_ids)))}
        missing = [i for i in item_ids if i not in found]
        if missing:
            if not self.catalogue.items(tenant, user):
                raise NotFoundError(f"user {user!r} of tenant {tenant!r} has no memories on this node")
            other = {r.item_id for r in self.catalogue.items(tenant, user, None, missing)}
            if other:
                raise FingerprintMismatchError(
                    f"items {sorted(other)} of {tenant}/{user} were encoded for another model than "
                    f"{fingerprint[:16]}; re-encode them")
            raise NotFoundError(f"items {missing} not found for tenant {tenant!r} user {user!r}")
        corrupt = [found[i] for i in item_ids if found[i].corrupt]
        if corrupt:
            self.raise_corrupt(tenant, user, [r.item_id for r in corrupt], mark=False)
        return [found[i] for i in item_ids]

    def store_images(self, tenant: str, user: str, images: list[tuple[memoryview, BlobInfo]]) -> list[ItemInfo]:
        """Write verified plain images as their items' current versions, to disk only, in one batch (a peer pull)."""
        writes = []
        for image, info in images:
            check_name("item", info.item_id)
            check_fingerprint(info.fingerprint)
            item, emb = self._row(tenant, user, image, info)
            writes.append((item, image, emb))
        self.disk.write_many(writes, self._invalidate, self.hasher)
        return [w[0] for w in writes]

    def _row(self, tenant: str, user: str, image: memoryview, info: BlobInfo) -> tuple[ItemInfo, bytes | None]:
        """The catalogue row of a new version (its generation still to fill) and its plain embedding."""
        emb = None if info.emb_range is None else bytes(image[info.emb_range[0] : info.emb_range[1]])
        key = (tenant, user, info.fingerprint, info.item_id)
        return item_info(tenant, user, info, item_path(self.root, *key), time.time()), emb

    def _invalidate(self, key: Key) -> None:  # with the catalogue change of a put, under the write lock
        self.dram.invalidate(key)  # cached copies are stale from here on; loads in flight are fenced off
        if self.gpu is not None:
            self.gpu.drop(lambda k: k == key)

    def raise_corrupt(self, tenant: str, user: str, items: list[str], *, mark: bool) -> None:
        if mark:
            rows = self.catalogue.items(tenant, user, None, items)
            self.catalogue.set_flag([r.key for r in rows], "corrupt", 1)
            self.counters["corrupt"] += len(items)
        err = BlobCorruptError(f"items {sorted(set(items))} of {tenant}/{user} are corrupt; re-encode them")
        err.item_ids = sorted(set(items))  # type: ignore[attr-defined]
        raise err

    def ensure_dram(self, tenant: str, rows: list[ItemInfo], protect: set[Key]
                     ) -> tuple[dict[Key, DramEntry], list[DramEntry], list[Key]]:
        """DRAM entries (one reference each, owned by the caller) for ``rows``, loading misses from disk in
        one batch. Returns (entries, entries loaded from disk, keys evicted)."""
        entries: dict[Key, DramEntry] = {}
        misses = []
        for r in rows:
            e = self.dram.acquire(r.key)
            if e is None:
                misses.append(r)
            else:
                entries[r.key] = e
        if not misses:
            return entries, [], []
        try:
            loaded, evicted = load_from_disk(self, tenant, misses, protect)
        except BaseException:
            for e in entries.values():
                self.dram.release(e)
            raise
        entries.update({e.key: e for e in loaded})
        return entries, loaded, evicted

    def replaced_since(self, key: Key, file_size: int, gens: dict[Key, int]) -> bool:
        """Whether a file of ``file_size`` bytes is explained by a put of ``key`` since its catalogue row was read:
        the key changed since ``gens``, or the catalogue now holds a row of that size (the put came between the
        row read and ``gens``). Waits out a put in progress."""
        with self._write_lock:
            if self.dram.generation(key) != gens[key]:
                return True
            rows = self.catalogue.items(key[0], key[1], key[2], [key[3]])
            if not rows:
                return False
            plain = rows[0].size
            return file_size == plain if self.keyring is None else file_size >= plain + sealing.TAG_BYTES

    def changed_since(self, key: Key, sha: str, gens: dict[Key, int]) -> bool:
        """Whether an intact blob that disagrees with the catalogue row read earlier is explained by a put
        of the key since then (not corruption). Waits out a put in progress."""
        with self._write_lock:
            if self.dram.generation(key) != gens[key]:
                return True
            rows = self.catalogue.items(key[0], key[1], key[2], [key[3]])
            return bool(rows) and rows[0].sha256 == sha

    def _remove(self, tenant: str, user: str, item_ids: list[str] | None, fingerprint: str | None
                ) -> tuple[int, int]:
        check_name("tenant", tenant), check_name("user", user)
        for i in item_ids or []:
            check_name("item", i)
        rows = self.catalogue.items(tenant, user, fingerprint, item_ids)
        if not rows:
            return 0, 0
        keys = {r.key for r in rows}
        with self._write_lock:
            for k in keys:
                self.dram.invalidate(k)
            if self.gpu is not None:
                self.gpu.drop(keys.__contains__)
            for r in rows:
                Path(r.path).unlink(missing_ok=True)
                for d in (Path(r.path).parent, Path(r.path).parent.parent):
                    try:
                        d.rmdir()  # only when empty
                    except OSError:
                        pass
            self.catalogue.delete(list(keys))
        self._pins.difference_update(keys)
        return len(rows), sum(r.size for r in rows)

    def _set_pin(self, tenant: str, user: str, item_ids: list[str] | None, on: bool) -> int:
        check_name("tenant", tenant), check_name("user", user)
        rows = self.catalogue.items(tenant, user, None, item_ids)
        if not rows or (item_ids is not None and {r.item_id for r in rows} != set(item_ids)):
            raise NotFoundError(f"items {item_ids or 'all'} not found for tenant {tenant!r} user {user!r}")
        keys = [r.key for r in rows]
        self.catalogue.set_flag(keys, "pinned", int(on))
        (self._pins.update if on else self._pins.difference_update)(keys)
        return len(keys)

