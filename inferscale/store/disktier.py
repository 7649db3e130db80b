"""The disk tier (G3): blob files under the store root, sealed when the store has a keyring, and the catalogue
rows that say which version of each item is current (inferscale/store/versions.py). Writes, rebuilds and key
rotations of the blobs live here; reads into DRAM are inferscale/store/diskload.py.

Every directory of the layout is 0700 and every file 0600: they hold tenants' data."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from inferscale import sealing
from inferscale.errors import BlobAuthError, BlobCorruptError
from inferscale.store.blob import BlobInfo, open_image, rewrap_blobs
from inferscale.store.catalogue import Catalogue, ItemInfo
from inferscale.store.layout import FP_DIR_LEN, scan_blobs, write_recorded
from inferscale.store.versions import CatalogueSeal

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

    # -- writes -----------------------------------------------------------------------------------------------
    def write(self, item: ItemInfo, image: memoryview, embedding: bytes | None, on_record: Callable[[], None]
              ) -> ItemInfo:
        """Write ``image`` as the item's new current version (sealed under the next generation) and record it,
        atomically with ``on_record`` (run under the write lock with the catalogue change)."""
        key, path = item.key, Path(item.path)
        make_private_dirs(self.root, path.parent)
        on_disk: bytes | memoryview = image
        if self.seal is not None:  # sealed outside the lock; row and blob name the same generation either way
            prev = self.catalogue.items(*key[:3], [key[3]])
            item.generation = self.seal.next_generation(prev[0].generation if prev else 0)
            item.row_mac = self.seal.row_mac(key, item.generation, item.sha256, item.size)
            if embedding is not None:
                embedding = self.seal.seal_embedding(key, item.generation, embedding)
            on_disk = sealing.seal(image, self.keyring, sealing.Binding(*key[:2], key[3], key[2], item.generation))

        def record() -> None:
            on_record()
            self.catalogue.upsert(item, embedding)

        # File and catalogue change together: a reader never sees a new file with an old catalogue entry for
        # longer than this section, and two writers of one key cannot leave them disagreeing.
        with self.lock:
            write_recorded(path, on_disk, record)  # StorageError: old blob (or none) and catalogue row kept
        return item

    # -- maintenance ------------------------------------------------------------------------------------------
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
                emb = self._rebuilt_row(item, data, image, info)
            except BlobAuthError as e:
                log.warning("rebuild: skipping %s", e)
                continue
            self.catalogue.upsert(item, emb)
            n += 1
        log.info("catalogue rebuilt from %s: %d items", self.root, n)
        return n

    def _rebuilt_row(self, item: ItemInfo, data: bytes, image: memoryview, info: BlobInfo) -> bytes | None:
        """Fill ``item``'s generation and MAC from its blob; its embedding as the catalogue stores it. BlobAuthError
        when the catalogue already names a later generation of the item (that row, authenticated, stays)."""
        emb = None if info.emb_range is None else bytes(image[info.emb_range[0] : info.emb_range[1]])
        if self.seal is None:
            return emb
        gen = sealing.parse_sealed(data, source=item.path).generation or 0
        for row in self.catalogue.items(*item.key[:3], [item.key[3]]):
            if self.row_ok(row) and row.generation > gen:
                raise BlobAuthError(f"{item.path}: generation {gen} is older than the catalogue's current "
                                    f"{row.generation} (an older version restored?)")
        item.generation = gen
        item.row_mac = self.seal.row_mac(item.key, gen, item.sha256, item.size)
        return None if emb is None else self.seal.seal_embedding(item.key, gen, emb)

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
            for key, gen, emb in self.catalogue.sealed_embeddings():
                row = rows[key]
                if not self.row_ok(row):
                    continue  # not ours: left to fail its next load
                plain = None if emb is None else self.seal.open_embedding(key, gen, emb)
                resealed.append((key, self.seal.row_mac(key, gen, row.sha256, row.size),
                                 None if plain is None else self.seal.seal_embedding(key, gen, plain)))
            self.catalogue.reseal(resealed)
        return n

