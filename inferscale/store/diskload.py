"""Disk (G3) -> DRAM (G2): one batched read of a set of blobs into reserved arena slots, verified (sealed blobs:
authenticated and opened in place) in parallel before any is committed."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from inferscale import sealing
from inferscale.errors import BlobCorruptError
from inferscale.store.blob import BlobInfo, verify
from inferscale.store.catalogue import ItemInfo
from inferscale.store.tiers import DramEntry, Key

if TYPE_CHECKING:
    from inferscale.store.node import StoreNode

log = logging.getLogger(__name__)


def load_from_disk(store: StoreNode, tenant: str, rows: list[ItemInfo], protect: set[Key]
                   ) -> tuple[list[DramEntry], list[Key]]:
    """Load ``rows`` from disk into reserved DRAM slots in one batch (NIXL POSIX when present), verify them,
    commit the good ones. Returns (entries, one reference each, owned by the caller; keys evicted)."""
    fds: list[int] = []
    missing: list[str] = []
    opened: list[ItemInfo] = []
    gens = {r.key: store.dram.generation(r.key) for r in rows}  # before the files are opened
    try:
        for r in rows:
            if not store.disk.row_ok(r):  # a catalogue row this store did not write: never names a version
                log.warning("catalogue row of %s/%s/%s fails its MAC (edited?)", tenant, r.user, r.item_id)
                missing.append(r.item_id)
                continue
            try:
                fds.append(os.open(r.path, os.O_RDONLY))
                opened.append(r)
            except OSError:
                missing.append(r.item_id)
        sizes = [os.fstat(fd).st_size for fd in fds]
        for r, s in zip(list(opened), sizes):
            # r.size is the plain image; a sealed file adds its header and tag (checked when opened).
            if s != r.size if store.keyring is None else s < r.size + sealing.TAG_BYTES:
                # A put of the key since the row was read explains it (a new version may differ in size: its
                # metadata did); its content is then verified like any replaced blob. Else the file was
                # truncated or swapped behind our back.
                if not store.replaced_since(r.key, s, gens):
                    missing.append(r.item_id)  # truncated or replaced behind our back
        if missing:
            store.raise_corrupt(tenant, rows[0].user, missing, mark=True)
        # Each block offered to the DRAM cache; one the frequency filter refuses gets a bypass slot.
        offsets, evicted = store.dram.admit_misses(tenant, [r.key for r in opened], sizes, protect,
                                                   plain=[r.size for r in opened])
        try:
            slots = list(zip(fds, offsets, sizes))
            if store.disk_reader is not None:  # a throttled disk (tests, benchmarks: throttle.py), every slot
                for fd, off, size in slots:
                    store.disk_reader(fd, store.dram.view(off, size))
                slots = []
            elif store.transport is not None and store.transport.has_posix:  # one batch into the arena
                arena = [(fd, off, size) for fd, off, size in slots if store.dram.in_arena(off)]
                store.transport.read_files([(fd, size) for fd, _, size in arena], [off for _, off, _ in arena])
                slots = [s for s in slots if not store.dram.in_arena(s[1])]
            for fd, off, size in slots:  # no transport, or a bypassed block's own buffer
                pread_into(fd, store.dram.view(off, size))
        except BaseException:
            store.dram.abort(tenant, offsets, sizes)
            raise
    finally:
        for fd in fds:
            os.close(fd)
    good, bad = verify_slots(
        store, tenant, [(o, s, r.path, r.sha256, r.item_id, r.fingerprint) for o, s, r in zip(offsets, sizes, opened)],
        recheck=lambda item, sha: store.changed_since(
            (tenant, rows[0].user, rows[0].fingerprint, item), sha, gens),
        sealed_for=rows[0].user if store.keyring is not None else None,
        generations={r.item_id: r.generation for r in opened})
    loaded = [store.dram.commit(r.key, off, size, info, gens[r.key])
              for (off, size, info), r in zip(good, [r for r in opened if r.item_id not in bad])]
    if bad:
        for e in loaded:
            store.dram.release(e)
        store.raise_corrupt(tenant, rows[0].user, bad, mark=True)
    return loaded, evicted


def verify_slots(store: StoreNode, tenant: str, slots: list[tuple[int, int, str, str, str, str]],
                 recheck: Callable[[str, str], bool] | None = None, sealed_for: str | None = None,
                 generations: dict[str, int] | None = None) -> tuple[list[tuple[int, int, BlobInfo]], list[str]]:
    """Verify blob images in reserved arena slots, in parallel. Bad slots are given back. Returns
    ([(offset, size, info)] of good ones in order, [item ids] of bad ones).

    ``sealed_for`` (a user): the slots hold sealed files of that user; each is authenticated and opened in
    place (the plain image then starts at the slot's offset, and the slot's tail is given back).
    An intact blob whose checksum differs from the expected one may be a newer version written by a
    concurrent put: ``recheck(item, sha)`` decides before calling it corrupt. ``generations`` (item -> the
    catalogue's current generation): a sealed blob of any other generation is refused."""

    def check(slot: tuple[int, int, str, str, str, str]) -> tuple[BlobInfo, int] | None:
        off, size, source, sha, item, fp = slot
        try:
            plain = size
            if sealed_for is not None:
                view = store.dram.view(off, size)
                plain = sealing.open_into(view, view, store.keyring, tenant=tenant, user=sealed_for, item=item,
                                          fingerprint=fp, source=source,
                                          generation=None if generations is None else generations.get(item)
                                          ).body_len
            info = verify(store.dram.view(off, plain), source=source, expect_sha=None, expect_item=item,
                          expect_fingerprint=fp, digest=sealed_for is None)
            if info.sha256 != sha and (recheck is None or not recheck(item, info.sha256)):
                raise BlobCorruptError(f"{source}: checksum {info.sha256[:12]} is not the catalogued "
                                       f"{sha[:12]} (item {item!r})")
            return info, plain
        except BlobCorruptError as e:
            log.warning("%s", e)
            return None

    checked = list(store.hasher.map(check, slots)) if len(slots) > 1 else [check(s) for s in slots]
    good, bad = [], []
    for (off, size, _, _, item, _), res in zip(slots, checked):
        if res is None:
            store.dram.abort(tenant, [off], [size])
            bad.append(item)
        else:
            info, plain = res
            store.dram.shrink(tenant, off, size, plain)
            good.append((off, plain, info))
    return good, bad



def pread_into(fd: int, view: memoryview, offset: int = 0) -> None:
    """Fill ``view`` from the file at ``offset``."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise BlobCorruptError(f"file shrank while reading (fd {fd})")
        got += n
