"""The disk tier (G3): blob files under the store root, sealed when the store has a keyring, and the catalogue
rows that say which version of each item is current (inferscale/store/versions.py). Writes, rebuilds and key
rotations of the blobs live here; reads into DRAM are inferscale/store/diskload.py.

Every directory of the layout is 0700 and every file 0600: they hold tenants' data."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

import torch

from inferscale import sealing
from inferscale.errors import BlobAuthError, BlobCorruptError
from inferscale.store.blob import BlobInfo, open_image, rewrap_blobs
from inferscale.store.catalogue import Catalogue, ItemInfo
from inferscale.kvformat import fsync_dir
from inferscale.store.layout import FP_DIR_LEN, commit_staged, scan_blobs, stage, write_recorded
from inferscale.store.memrecord import MemoryRecord, parse_record, record_bytes
from inferscale.store.versions import FIELDS, CatalogueSeal, Key

# A row's sealed fields as the catalogue stores them (versions.FIELDS): "embedding" and "memory", None when absent.
Fields = dict[str, bytes | None]


def row_fields(info: BlobInfo, image: memoryview) -> Fields:
    """The plain fields of a blob's catalogue row: its retrieval embedding and its memory record."""
    emb = None if info.emb_range is None else bytes(image[info.emb_range[0] : info.emb_range[1]])
    return {"embedding": emb, "memory": record_bytes(info)}

log = logging.getLogger(__name__)


def make_private_dirs(root: Path, directory: Path) -> None:
    """``directory`` (under ``root``) and every directory between them, each 0700."""
    root = Path(root)
    d = root
    for part in Path(directory).relative_to(root).parts:
        d = d / part
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass


def item_info(tenant: str, user: str, info: BlobInfo, path: Path, created: float) -> ItemInfo:
    """The catalogue row of a blob (generation and MAC are the disk tier's to fill)."""
    return ItemInfo(tenant, user, info.fingerprint, info.item_id, str(path), info.size, info.kv_bytes,
                    info.tokens, info.sha256, [], 0.0, False, False, created, info.context)


class DiskTier:
    def __init__(self, root: Path, catalogue: Catalogue, keyring: sealing.Keyring | None,
                 write_lock: threading.Lock) -> None:
        self.root, self.catalogue, self.keyring, self.lock = Path(root), catalogue, keyring, write_lock
        self.seal = None if keyring is None else CatalogueSeal(keyring)
        os.chmod(self.root, 0o700)

    # -- what is current ---------------------------------------------------------------------------------------
    def row_ok(self, row: ItemInfo) -> bool:
        """Whether the catalogue row is one this store wrote (its MAC verifies); always, unsealed."""
        return self.seal is None or self.seal.row_ok(row.key, row.generation, row.sha256, row.size, row.row_mac)

    def embedding_matrix(self, rows: list[tuple[str, bytes, int]], tenant: str, user: str,
                         fingerprint: str) -> torch.Tensor:
        """[n, dim] float32 of catalogue embedding rows (item, stored bytes, generation), opened when sealed."""
        def plain(item: str, stored: bytes, gen: int) -> bytes:
            if self.seal is None:
                return stored
            return self.seal.open_embedding((tenant, user, fingerprint, item), gen, stored)

        return torch.stack([torch.frombuffer(bytearray(plain(*r)), dtype=torch.float32) for r in rows])

    def memory_records(self, tenant: str, user: str, fingerprint: str, item_ids: list[str]
                       ) -> dict[str, MemoryRecord]:
        """item -> memory record of those of ``item_ids`` whose record opens; one that fails authentication is
        left out (logged): its blob, fetched instead, is checked on its own."""
        out: dict[str, MemoryRecord] = {}
        for item, stored, gen in self.catalogue.memories(tenant, user, fingerprint, item_ids):
            try:
                plain = stored if self.seal is None else self.seal.open_field(
                    "memory", (tenant, user, fingerprint, item), gen, stored)
                out[item] = parse_record(item, plain)
            except BlobCorruptError as e:  # BlobAuthError included
                log.warning("%s/%s: %s", tenant, user, e)
        return out

    # -- writes -----------------------------------------------------------------------------------------------
    def write(self, item: ItemInfo, image: memoryview, fields: Fields, on_record: Callable[[], None]
              ) -> ItemInfo:
        """Write ``image`` as the item's new current version (sealed under the next generation) and record it
        with its row ``fields``, atomically with ``on_record`` (run under the write lock with the catalogue
        change)."""
        on_disk, fields = self._prepare(item, image, fields)
        # File and catalogue change together: a reader never sees a new file with an old catalogue entry for
        # longer than this section, and two writers of one key cannot leave them disagreeing.
        with self.lock:
            write_recorded(Path(item.path), on_disk, self._recorder(item, fields, on_record))
        return item

    def write_many(self, writes: list[tuple[ItemInfo, memoryview, Fields]],
                   on_record: Callable[[Key], None], pool: Executor) -> None:
        """``write`` for a batch (a peer pull): the files are staged and fsynced in parallel on ``pool``, then each
        is renamed and recorded in turn, and each directory fsynced once. A failure leaves the items before it
        written and the rest untouched (StorageError)."""
        prepared = [(item, *self._prepare(item, image, fields)) for item, image, fields in writes]
        futures = [pool.submit(stage, Path(item.path), on_disk) for item, on_disk, _ in prepared]
        staged: list[Path | None] = []
        failure: BaseException | None = None
        for f in futures:
            try:
                staged.append(f.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below, once every temp file is accounted for
                staged.append(None)
                failure = failure or e
        done = 0
        try:
            if failure is not None:
                raise failure
            with self.lock:
                for (item, _, emb), tmp in zip(prepared, staged):
                    commit_staged(Path(item.path), tmp, self._recorder(item, emb, lambda k=item.key: on_record(k)),
                                  sync_dir=False)
                    done += 1
        finally:
            for tmp in staged[done:]:
                if tmp is not None:
                    tmp.unlink(missing_ok=True)
            for d in {Path(item.path).parent for item, _, _ in prepared[:done]}:
                fsync_dir(d)

    def _prepare(self, item: ItemInfo, image: memoryview, fields: Fields) -> tuple[bytes | memoryview, Fields]:
        """(the bytes to write, the row fields as the catalogue stores them); fills the item's generation and MAC.
        Sealed outside the write lock: row and blob name the same generation either way."""
        key = item.key
        make_private_dirs(self.root, Path(item.path).parent)
        if self.seal is None:
            return image, fields
        prev = self.catalogue.items(*key[:3], [key[3]])
        item.generation = self.seal.next_generation(prev[0].generation if prev else 0)
        item.row_mac = self.seal.row_mac(key, item.generation, item.sha256, item.size)
        return (sealing.seal(image, self.keyring, sealing.Binding(*key[:2], key[3], key[2], item.generation)),
                self._seal_fields(key, item.generation, fields))

    def _seal_fields(self, key: Key, generation: int, fields: Fields) -> Fields:
        assert self.seal is not None
        return {name: None if fields.get(name) is None else self.seal.seal_field(name, key, generation, fields[name])
                for name in FIELDS}

    def _recorder(self, item: ItemInfo, fields: Fields, on_record: Callable[[], None]) -> Callable[[], None]:
        def record() -> None:
            on_record()
            self.catalogue.upsert(item, fields.get("embedding"), fields.get("memory"))

        return record

    # -- maintenance ------------------------------------------------------------------------------------------
    def remove(self, rows: list[ItemInfo]) -> None:
        """Delete these items' blobs, their user and tenant directories once empty, and their rows (under the
        caller's write lock)."""
        for r in rows:
            Path(r.path).unlink(missing_ok=True)
            for d in (Path(r.path).parent, Path(r.path).parent.parent):
                try:
                    d.rmdir()  # only when empty
                except OSError:
                    pass
        self.catalogue.delete([r.key for r in rows])

    def rebuild(self) -> int:
        """Re-catalogue every blob (after the catalogue was lost). Each blob is opened and verified
        (authenticated, when sealed) before it is trusted; one that fails, or that is older than a row this store
        wrote for it (a rolled-back blob), is skipped and reported. Returns items found."""
        n = 0
        for tenant, user, path in scan_blobs(self.root):
            try:
                data = path.read_bytes()
                image, info = open_image(data, self.keyring, tenant=tenant, user=user, item=path.stem,
                                         source=str(path))
            except OSError as e:
                log.warning("rebuild: skipping %s: cannot read (%s)", path, e.strerror or e)
                continue
            except BlobCorruptError as e:
                log.warning("rebuild: skipping unverified blob: %s", e)
                continue
            if path.parent.name != info.fingerprint[:FP_DIR_LEN]:
                log.warning("rebuild: %s holds item %r of model %s; skipped", path, info.item_id, info.fingerprint[:16])
                continue
            item = item_info(tenant, user, info, path, os.stat(path).st_mtime)
            try:
                fields = self._rebuilt_row(item, data, image, info)
            except BlobAuthError as e:
                log.warning("rebuild: skipping %s", e)
                continue
            self.catalogue.upsert(item, fields["embedding"], fields["memory"])
            n += 1
        log.info("catalogue rebuilt from %s: %d items", self.root, n)
        return n

    def _rebuilt_row(self, item: ItemInfo, data: bytes, image: memoryview, info: BlobInfo) -> Fields:
        """Fill ``item``'s generation and MAC from its blob; its row fields as the catalogue stores them.
        BlobAuthError when the catalogue already names a later generation of the item (that row, authenticated,
        stays)."""
        fields = row_fields(info, image)
        if self.seal is None:
            return fields
        gen = sealing.parse_sealed(data, source=item.path).generation or 0
        for row in self.catalogue.items(*item.key[:3], [item.key[3]]):
            if self.row_ok(row) and row.generation > gen:
                raise BlobAuthError(f"{item.path}: generation {gen} is older than the catalogue's current "
                                    f"{row.generation} (an older version restored?)")
        item.generation = gen
        item.row_mac = self.seal.row_mac(item.key, gen, item.sha256, item.size)
        return self._seal_fields(item.key, gen, fields)

    def rotate_keys(self) -> int:
        """Re-wrap every sealed blob's data key under the keyring's current KEK line (the ciphertext is copied,
        not re-encrypted), and re-MAC and re-seal every catalogue row under it; afterwards older KEK lines can be
        dropped. Returns blobs rewritten."""
        assert self.seal is not None and self.keyring is not None
        # Under the write lock: a concurrent put of a key must not be overwritten with its old blob.
        n = rewrap_blobs(scan_blobs(self.root), self.keyring, self.lock)
        with self.lock:
            rows = {r.key: r for r in self.catalogue.all_items()}
            resealed = []
            for key, gen, emb, mem in self.catalogue.sealed_fields():
                row = rows[key]
                if not self.row_ok(row):
                    continue  # not ours: left to fail its next load
                stored = {"embedding": emb, "memory": mem}
                plain = {n: None if v is None else self.seal.open_field(n, key, gen, v) for n, v in stored.items()}
                fields = self._seal_fields(key, gen, plain)
                resealed.append((key, self.seal.row_mac(key, gen, row.sha256, row.size), fields["embedding"],
                                 fields["memory"]))
            self.catalogue.reseal(resealed)
        return n

