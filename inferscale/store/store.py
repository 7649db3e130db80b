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
from collections.abc import Callable
from typing import Any

import torch

from inferscale import sealing
from inferscale.errors import (
    BlobCorruptError, ConfigError, FingerprintMismatchError, NotFoundError,
)
from inferscale.fleettls import FleetTls
from inferscale.kvformat import KVBlock, encode_blob
from inferscale.store.arena import Arena
from inferscale.store.blob import BlobInfo, parse_header, remove_orphan_temps
from inferscale.store.catalogue import Catalogue, ItemInfo
from inferscale.store.diskload import load_from_disk
from inferscale.store.jobdir import read_job_dir
from inferscale.store.disktier import DiskTier, Fields, item_info, row_fields
from inferscale.store.layout import CATALOGUE_NAME, check_fingerprint, check_name, item_path, request_keys
from inferscale.store.memrecord import MemoryRecord
from inferscale.store.results import FetchStats, PullResult, meter_fetch
from inferscale.store.blockcache import BlockCache
from inferscale.store.devicetier import DeviceTier
from inferscale.store.peer_pool import PeerSessions
from inferscale.store.tier import TransferMeter
from inferscale.store.tiers import DramEntry, DramTier, Key

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
        peer_tls: FleetTls | None = None,
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
        self.peer_tls = peer_tls  # the peer channel's TLS (both ways) when the fleet has certificates
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
            self.disk.rebuild()
        # A budget that cannot hold one block would make every request fail: refuse it at start.
        floor = max(min_block_bytes, self.catalogue.max_size())
        for name, v in (("DRAM budget", dram_budget_bytes), ("GPU budget", gpu_budget_bytes or None),
                        ("tenant quota", tenant_quota_bytes)):
            if v is not None and v < floor:
                raise ConfigError(f"{name} of {v} bytes is smaller than one block ({floor} bytes)")
        self.gpu: DeviceTier | None = None
        if gpu_budget_bytes:
            dev = torch.device(device) if device is not None else torch.device("cuda")
            if dev.type == "cuda" and torch.cuda.is_available():
                self.gpu = DeviceTier(dev, BlockCache(gpu_budget_bytes, default_share=tenant_quota_bytes))
            else:
                log.warning("GPU budget set but %s is unavailable: device tier disabled", dev)
        # Per-block caches (store.tier): the arena holds the DRAM cache's budget plus its bypass room.
        self.arena = Arena(DramTier.arena_bytes(dram_budget_bytes), pin=self.gpu is not None)
        self.dram = DramTier(self.arena, BlockCache(dram_budget_bytes, default_share=tenant_quota_bytes))
        self.tiers = [t for t in (self.gpu, self.dram) if t is not None]  # fastest first
        # What each fetch cost, per tier (FetchPlanner's tier names): the planner learns from these.
        self.transfers: dict[str, TransferMeter] = {t.name: t.transfers for t in self.tiers}
        self.transfers["disk"] = TransferMeter("disk")
        pinned = list(self.catalogue.pinned_keys())
        for t in self.tiers:
            t.set_pinned(pinned, True)
        self.transport = None
        if nixl:
            from inferscale.store.nixl_transport import NixlTransport

            self.transport = NixlTransport(self.arena, name=f"{self.node}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                                           timeout_s=timeout_s, ucx_port_range=ucx_port_range)
        self.peer_sessions = PeerSessions(tls=peer_tls)  # this node's pulls: sessions kept open between them
        self.hasher = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                          thread_name_prefix="kvstore-verify")
        self.counters = {"gpu_hits": 0, "dram_hits": 0, "disk_reads": 0, "peer_pulls": 0, "corrupt": 0}
        # Reads a blob file into an arena slot instead of NIXL POSIX / pread: a hook for tests and benchmarks that
        # slow the disk for real (inferscale/store/throttle.py). None: the normal path.
        self.disk_reader: Callable[[int, memoryview], None] | None = None
        self.peer_service = None
        if peer_port is not None:
            from inferscale.store.serving import PeerService

            if peer_secret is None:
                raise ConfigError("serving peers (peer_port) needs a peer secret (INFERSCALE_PEER_SECRET)")
            self.peer_service = PeerService(self, peer_host, peer_port, secret=peer_secret, timeout_s=timeout_s,
                                            tls=peer_tls)

    # -- lifecycle ------------------------------------------------------------------------------------------
    @property
    def peer_address(self) -> str | None:
        return None if self.peer_service is None else f"{self.node}:{self.peer_service.port}"

    def close(self) -> None:
        if self.peer_service is not None:
            self.peer_service.close()
        self.peer_sessions.close()
        self.hasher.shutdown(wait=True)
        if self.transport is not None:
            self.transport.close()
        self.catalogue.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rebuild(self) -> int:
        """Re-catalogue every blob in the disk tier (after the catalogue was lost); see DiskTier.rebuild. Cached
        copies go first: what is current is the rebuilt catalogue's to say (a DRAM hit does not ask it)."""
        with self._write_lock:
            for t in self.tiers:
                t.drop(lambda k: True)
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
        keys = request_keys(tenant, user, fingerprint, item_ids)  # unique; duplicates share a block
        protect = set(keys)
        stats = FetchStats()
        out: dict[Key, KVBlock] = {}
        # All DRAM-resident (the hot path): the catalogue has nothing to add. An entry is resident only while its
        # key's current, verified version is: every put, delete, corrupt mark and rebuild drops it first.
        held = self.dram.acquire_all(keys) if self.gpu is None else None
        if held is not None:
            entries, loaded, rest, t_gpu = dict(zip(keys, held)), [], keys, time.perf_counter()
        else:
            rows = list({r.key: r for r in self._rows(tenant, user, fingerprint, list(item_ids))}.values())
            if self.gpu is not None:
                for r in rows:
                    b = self.gpu.get(r.key, r.size)
                    if b is not None:
                        out[r.key] = b
                        stats.served[r.item_id] = "gpu"
            rest_rows = [r for r in rows if r.key not in out]
            t_gpu = time.perf_counter()
            entries, loaded, _ = self.ensure_dram(tenant, rest_rows, protect)
            rest = [r.key for r in rest_rows]
        disk_s = time.perf_counter() - t_gpu if loaded else 0.0  # the batched load (and the hits' lookups)
        from_disk = {e.key for e in loaded}
        for k in rest:
            e = entries[k]
            b = self.dram.lease_block(e)
            if copy:
                b.kv = b.kv.clone()
                b.kv_scale = None if b.kv_scale is None else b.kv_scale.clone()
            if self.gpu is not None:
                b, _ = self.gpu.put(k, b, protect, cache=not e.dead)
            out[k] = b
            stats.served[k[3]] = "disk" if k in from_disk else "dram"
            if k in from_disk:
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
        meter_fetch(stats, out, self.transfers, t_gpu - t0, stats.seconds - (t_gpu - t0), disk_s)
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
        return self._residency(rows)

    def locate(self, tenant: str, user: str, item_ids: list[str], fingerprint: str) -> dict[str, ItemInfo]:
        """item -> catalogue row (``tiers``: where it is now, fastest first) of those of ``item_ids`` stored here
        and not corrupt: what the fetch planner decides on. Reads nothing from disk and promotes nothing."""
        check_name("tenant", tenant), check_name("user", user), check_fingerprint(fingerprint)
        rows = self.catalogue.items(tenant, user, fingerprint, [check_name("item", i) for i in set(item_ids)])
        return {r.item_id: r for r in self._residency([r for r in rows if not r.corrupt])}

    def memory_records(self, tenant: str, user: str, item_ids: list[str], fingerprint: str) -> dict[str, MemoryRecord]:
        """item -> memory record (text, token ids) of those of ``item_ids`` stored here, from the catalogue (opened
        when sealed), no blob read: what recomputing a memory needs."""
        check_name("tenant", tenant), check_name("user", user), check_fingerprint(fingerprint)
        return self.disk.memory_records(tenant, user, fingerprint, [check_name("item", i) for i in set(item_ids)])

    def _residency(self, rows: list[ItemInfo]) -> list[ItemInfo]:
        for r in rows:  # residency from the tiers themselves (fastest first), never stale
            r.tiers = [*(t.name for t in self.tiers if t.resident(r.key)), "disk"]
        return rows

    def reorder(self, tenant: str, user: str, fingerprint: str, item_ids: list[str]) -> None:
        """Make ``item_ids`` (of this model) the user's list order, after every item stored before now."""
        check_name("tenant", tenant), check_name("user", user), check_fingerprint(fingerprint)
        with self._write_lock:
            self.catalogue.set_order(tenant, user, fingerprint, [check_name("item", i) for i in item_ids], time.time())

    def usage(self, tenant: str) -> tuple[int, int]:  # (items, bytes on disk) of the tenant, every user and model
        return self.catalogue.usage(tenant)

    def set_tenant_quota(self, tenant: str, dram_bytes: int | None) -> None:  # None: tenant_quota_bytes
        self.dram.set_share(tenant, dram_bytes)

    def users(self, tenant: str) -> list[str]:
        users = self.catalogue.users(check_name("tenant", tenant))
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
        """Adopt an encoding Job's output (``DIR/<id><SUFFIX>``), every blob authenticated before any is stored, none
        read through a symlink (store/jobdir.py): disk, and DRAM with ``load``."""
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
                       fingerprint: str | None = None, *, source_dir: str | None = None,
                       sizes: list[int] | None = None) -> PullResult:
        """Copy a user's blocks from a peer (a lease the owner writes, store/pulling.py) into DRAM and disk, every
        checksum verified; TransferError when the peer is unreachable or slow. ``source_dir``: a Job dir there.
        ``sizes``: the items' blob sizes at the peer, from its index (one round trip instead of two)."""
        from inferscale.store.pulling import pull_from_peer

        return pull_from_peer(self, tenant, user, peer, item_ids, fingerprint, source_dir, sizes)

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
        item, fields = self._row(tenant, user, image, info)
        self.disk.write(item, image, fields, lambda: self._invalidate(key))
        with self._write_lock:
            gen = self.dram.generation(key)
        if cache:  # a put or a warm-up: offered to the cache like any block, never pushing out hotter ones
            off = self.dram.offer(tenant, key, len(image))
            if off is None:
                return item  # not admitted now; it is on disk and loads on demand
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
            item, fields = self._row(tenant, user, image, info)
            writes.append((item, image, fields))
        self.disk.write_many(writes, self._invalidate, self.hasher)
        return [w[0] for w in writes]

    def _row(self, tenant: str, user: str, image: memoryview, info: BlobInfo) -> tuple[ItemInfo, Fields]:
        """A new version's catalogue row (its generation still to fill) and plain fields (embedding, memory record)."""
        key = (tenant, user, info.fingerprint, info.item_id)
        return item_info(tenant, user, info, item_path(self.root, *key), time.time()), row_fields(info, image)

    def _invalidate(self, key: Key) -> None:  # with the catalogue change of a put, under the write lock
        self.dram.invalidate(key)  # cached copies are stale from here on; loads in flight are fenced off
        if self.gpu is not None:
            self.gpu.drop(lambda k: k == key)

    def raise_corrupt(self, tenant: str, user: str, items: list[str], *, mark: bool) -> None:
        if mark:
            rows = self.catalogue.items(tenant, user, None, items)
            with self._write_lock:  # a corrupt item is never served from a cached copy either
                self.catalogue.set_flag([r.key for r in rows], "corrupt", 1)
                for r in rows:
                    self._invalidate(r.key)
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
        for r, e in zip(rows, self.dram.acquire_many([r.key for r in rows], [r.size for r in rows])):
            if e is None:
                misses.append(r)
            else:
                entries[r.key] = e
        if not misses:
            return entries, [], []
        t0 = time.perf_counter()
        try:
            loaded, evicted = load_from_disk(self, tenant, misses, protect)
        except BaseException:
            for e in entries.values():
                self.dram.release(e)
            raise
        self.transfers["disk"].record(len(loaded), sum(e.size for e in loaded), time.perf_counter() - t0)
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
            self.disk.remove(rows)
        for t in self.tiers:
            t.set_pinned(list(keys), False)
        return len(rows), sum(r.size for r in rows)

    def _set_pin(self, tenant: str, user: str, item_ids: list[str] | None, on: bool) -> int:
        check_name("tenant", tenant), check_name("user", user)
        rows = self.catalogue.items(tenant, user, None, item_ids)
        if not rows or (item_ids is not None and {r.item_id for r in rows} != set(item_ids)):
            raise NotFoundError(f"items {item_ids or 'all'} not found for tenant {tenant!r} user {user!r}")
        keys = [r.key for r in rows]
        self.catalogue.set_flag(keys, "pinned", int(on))
        for t in self.tiers:
            t.set_pinned(keys, on)
        return len(keys)

