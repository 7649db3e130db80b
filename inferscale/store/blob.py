"""The store's blob files: headers read from disk, images verified against the catalogue or a peer's checksum,
sealed blobs opened for their place, orphan temps removed, data keys re-wrapped. The image parser itself is
``inferscale.blobimage`` (the one reader of the format)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from inferscale import sealing
from inferscale.blobimage import MAX_HEADER, BlobInfo, parse_header, tensor_digest
from inferscale.errors import BlobCorruptError
from inferscale.kvformat import SUFFIX, TEMP_SUFFIX, atomic_write


def read_header(path: Path) -> BlobInfo:
    """Parse a blob file's header without reading its tensors."""
    try:
        with open(path, "rb") as f:
            first = f.read(8)
            n = int.from_bytes(first, "little") if len(first) == 8 else 0
            if n > MAX_HEADER:
                raise BlobCorruptError(f"{path}: not a readable KV blob (header of {n} bytes)")
            head = first + f.read(n)
            total = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise BlobCorruptError(f"{path}: cannot read ({e.strerror or e})") from None
    return parse_header(head, source=str(path), total=total)


def verify(image: memoryview, *, source: str, expect_sha: str | None, expect_item: str | None = None,
           expect_fingerprint: str | None = None, digest: bool = True) -> BlobInfo:
    """Parse and check one blob image: header sane, sha256 of its tensors equals the header's and ``expect_sha``
    (the catalogue's or the peer's), item and fingerprint as expected. Raises BlobCorruptError.

    ``digest=False`` skips hashing the tensors, for an image just opened from a sealed blob: AES-GCM has
    authenticated every byte of it (the header's sha256 is still compared with ``expect_sha``)."""
    info = parse_header(image, source=source, total=len(image))
    digest = tensor_digest(image, info) if digest else info.sha256
    if digest != info.sha256 or (expect_sha is not None and digest != expect_sha):
        raise BlobCorruptError(f"{source}: checksum mismatch (item {info.item_id!r})")
    if expect_item is not None and info.item_id != expect_item:
        raise BlobCorruptError(f"{source}: holds item {info.item_id!r}, expected {expect_item!r}")
    if expect_fingerprint is not None and info.fingerprint != expect_fingerprint:
        raise BlobCorruptError(f"{source}: holds model {info.fingerprint[:16]}, expected {expect_fingerprint[:16]}")
    return info


def open_image(data: bytes | memoryview, keyring: sealing.Keyring | None, *, tenant: str, user: str, item: str,
               source: str) -> tuple[memoryview, BlobInfo]:
    """The verified plain image of one blob file's bytes that must belong to (tenant, user, item): with a
    keyring only a blob sealed for exactly that place opens (BlobAuthError otherwise, plain blobs included);
    without one (an unsealed store) the image is checked by its sha256 alone."""
    if keyring is None:
        image = memoryview(data).cast("B")
        return image, verify(image, source=source, expect_sha=None, expect_item=item)
    image = sealing.open_blob(data, keyring, tenant=tenant, user=user, item=item, source=source)
    return image, verify(image, source=source, expect_sha=None, expect_item=item, digest=False)


def remove_orphan_temps(root: Path) -> int:
    """Delete temp files a crashed write left in the store layout (``<root>/<t>/<u>/<fp>/.<item>*.tmp``)."""
    n = 0
    for p in Path(root).glob(f"*/*/*/.*{SUFFIX}.*{TEMP_SUFFIX}"):
        try:
            p.unlink()
            n += 1
        except OSError:
            pass
    return n


def rewrap_blobs(blobs: list[tuple[str, str, Path]], keyring: sealing.Keyring, lock: threading.Lock) -> int:
    """Re-wrap the data key of each (tenant, user, path) sealed blob under the keyring's current KEK line,
    each file rewritten atomically while holding ``lock``. Returns blobs rewritten."""
    n = 0
    for tenant, _user, path in blobs:
        with lock:
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # deleted meanwhile
                continue
            new = sealing.rewrap(data, keyring, tenant=tenant, source=str(path))
            if new is not None:
                atomic_write(path, new)
                n += 1
    return n
