"""Reading an encoding Job's output directory (``<kv host path>/<tenant>/<user>/<item><SUFFIX>``) without
following a symlink anywhere a tenant could plant one.

The directory is opened with O_DIRECTORY|O_NOFOLLOW and every blob relative to that descriptor with
O_NOFOLLOW (``dir_fd``), so a symlink swapped in after the path was checked (inferscale/jobpaths.py) cannot
point the import at another tenant's files. A hard link is refused too (a second name for a file elsewhere),
as is anything that is not a regular file. Every blob is read and verified before the caller stores any."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from inferscale.errors import BlobCorruptError, NotFoundError, UnsafePathError
from inferscale.kvformat import SUFFIX
from inferscale import sealing
from inferscale.store.blob import BlobInfo, open_image
from inferscale.store.layout import check_name

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: a FIFO planted under a blob's name must not hang the import (it is refused after fstat).
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _open_dir(directory: Path) -> int:
    try:
        return os.open(directory, _DIR_FLAGS)
    except FileNotFoundError:
        raise NotFoundError(f"blob directory {directory} does not exist") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(f"blob directory {directory} is a symlink or not a directory; refused") from None
        raise BlobCorruptError(f"blob directory {directory}: cannot open ({e.strerror or e})") from None


def _read_blob(dir_fd: int, directory: Path, name: str) -> bytes:
    where = directory / name
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(f"blob {where} is a symlink; refused") from None
        raise BlobCorruptError(f"{where}: cannot open ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"blob {where} is not a regular file; refused")
        if st.st_nlink != 1:
            raise UnsafePathError(f"blob {where} has {st.st_nlink} hard links (a name for a file elsewhere); refused")
        chunks, got = [], 0
        while got < st.st_size:
            chunk = os.pread(fd, st.st_size - got, got)
            if not chunk:
                raise BlobCorruptError(f"{where}: file shrank while reading")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise BlobCorruptError(f"{where}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def _check_owner(info: BlobInfo, where: Path, tenant: str, user: str) -> None:
    """Where the format records the tenant and user a blob was made for, they must be this directory's."""
    for field, want in (("tenant", tenant), ("user", user)):
        have = info.meta.get(field)
        if have is not None and have != want:
            raise UnsafePathError(f"blob {where} was made for {field} {have!r}, not {want!r}; refused")


def open_owned(data: bytes, keyring: sealing.Keyring | None, tenant: str, user: str, item: str,
               where: Path | str) -> tuple[memoryview, BlobInfo]:
    """One blob's verified plain image, refused unless it was made (and, with a keyring, sealed) for exactly
    (tenant, user, item). The one check for a Job's output, read from its directory or delivered (store/ingest.py)."""
    image, info = open_image(data, keyring, tenant=tenant, user=user, item=item, source=str(where))
    _check_owner(info, Path(where), tenant, user)
    return image, info


def read_job_dir(tenant: str, user: str, directory: str | os.PathLike, items: list[str] | None,
                 keyring: sealing.Keyring | None = None) -> list[tuple[memoryview, BlobInfo]]:
    """(plain image, info) of each blob of ``items`` (all when None) in ``directory``, verified, in name order.
    With a ``keyring`` only blobs sealed for exactly (tenant, user, item) open (``blob.open_image``).
    NotFoundError for a missing dir or item, UnsafePathError for a symlink/hard link/non-file, BlobCorruptError
    for a bad blob: all before anything is returned."""
    check_name("tenant", tenant), check_name("user", user)
    d = Path(directory)
    dir_fd = _open_dir(d)
    try:
        names = sorted(e.name for e in os.scandir(dir_fd)
                       if e.name.endswith(SUFFIX) and not e.name.startswith("."))
        by_item = {n[: -len(SUFFIX)]: n for n in names}
        if items is not None:
            missing = [i for i in items if i not in by_item]
            if missing:
                raise NotFoundError(f"items {missing} not found in {d}")
            by_item = {i: by_item[i] for i in items}
        out = []
        for item, name in by_item.items():
            check_name("item", item)
            data = _read_blob(dir_fd, d, name)
            out.append(open_owned(data, keyring, tenant, user, item, d / name))
        return out
    finally:
        os.close(dir_fd)
