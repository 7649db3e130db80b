"""A Job's delivered output: the sealed blobs an encode Job uploads to a serving pod, as one tar archive
(``POST /internal/v1/ingest/{tenant}/{user}``, server/ingest.py), and how it is read.

Tar (POSIX ustar/pax, no compression) because the standard library writes and reads it as a stream. What the
archive may hold is narrow: regular files only, each named ``<item><SUFFIX>`` at the top level (no directory, no
link, no device), at most ``MAX_MEMBERS`` of them, each no larger than the archive. Every blob is opened with the
same check as a Job directory's (``jobdir.open_owned``: sealed for exactly this tenant, user and item) before the
caller stores any, so one bad blob stores nothing.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from inferscale import sealing
from inferscale.errors import InvalidInputError
from inferscale.kvformat import SUFFIX
from inferscale.store.blob import BlobInfo
from inferscale.store.jobdir import open_owned
from inferscale.store.layout import check_name

MAX_MEMBERS = 4096


def _bad(why: str) -> InvalidInputError:
    return InvalidInputError(f"delivered archive: {why}", param="body")


def read_archive(tenant: str, user: str, fileobj: IO[bytes],
                 keyring: sealing.Keyring | None) -> list[tuple[memoryview, BlobInfo]]:
    """(plain image, info) of every blob in the archive, verified, in archive order; InvalidInputError for an
    archive that is not one, BlobAuthError/BlobCorruptError for a blob that does not open: before any is returned."""
    check_name("tenant", tenant), check_name("user", user)
    out: list[tuple[memoryview, BlobInfo]] = []
    seen: set[str] = set()
    try:
        with tarfile.open(fileobj=fileobj, mode="r|") as tar:  # a stream: members in order, nothing seeks
            for member in tar:
                if len(out) >= MAX_MEMBERS:
                    raise _bad(f"more than {MAX_MEMBERS} blobs")
                item = _member_item(member)
                if item in seen:
                    raise _bad(f"item {item!r} twice")
                seen.add(item)
                f = tar.extractfile(member)
                data = f.read() if f is not None else b""
                if len(data) != member.size:
                    raise _bad(f"member {member.name!r} is truncated")
                out.append(open_owned(data, keyring, tenant, user, item, f"delivered:{tenant}/{user}/{member.name}"))
    except tarfile.TarError as e:
        raise _bad(f"not a tar archive ({e})") from None
    if not out:
        raise _bad("no blob in it")
    return out


def _member_item(member: tarfile.TarInfo) -> str:
    if not member.isreg():
        raise _bad(f"member {member.name!r} is not a regular file")
    name = member.name
    if "/" in name or not name.endswith(SUFFIX) or name.startswith("."):
        raise _bad(f"member {name!r} must be <item>{SUFFIX} at the top level")
    return check_name("item", name[: -len(SUFFIX)])


def write_archive(directory: str | os.PathLike, names: Iterable[str], fileobj: IO[bytes]) -> int:
    """Write the blobs `names` of `directory` (a Job's own emptyDir) as a delivery archive; returns their count."""
    n = 0
    with tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(names):
            path = Path(directory) / name
            info = tarfile.TarInfo(name)
            info.size, info.mode = path.stat().st_size, 0o600
            with open(path, "rb") as f:
                tar.addfile(info, f)
            n += 1
    return n
