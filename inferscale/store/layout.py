"""Names and paths of the disk tier (G3).

Layout: ``<root>/<tenant>/<user>/<fingerprint[:16]>/<item><kvformat.SUFFIX>`` (sealed) plus ``<root>/catalogue.sqlite``.
Every name is checked against one pattern before it touches a path, so no name can climb out of its tenant's
directory (no ``..``, no ``/``, no leading dot)."""

from __future__ import annotations

import os
import re
import sqlite3
import tempfile
from pathlib import Path
from typing import Callable

from inferscale.contract import id_problem, is_valid_id
from inferscale.errors import InvalidInputError, StorageError
from inferscale.kvformat import SUFFIX, TEMP_SUFFIX, blob_path, fsync_dir, stage_file

FINGERPRINT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,255}$")
CATALOGUE_NAME = "catalogue.sqlite"
FP_DIR_LEN = 16


def check_name(kind: str, value: object) -> str:
    """Return ``value`` when it is a valid tenant/user/item name, else raise InvalidInputError naming it."""
    if is_valid_id(value):  # the hot path: names of every block of every read
        return value
    problem = id_problem(f"{kind} name", value)
    if problem:
        raise InvalidInputError(f"invalid {problem}")
    return value


def check_fingerprint(value: object) -> str:
    if not isinstance(value, str) or not FINGERPRINT_RE.match(value) or ".." in value:
        raise InvalidInputError(f"invalid model fingerprint {value!r}")
    return value


def request_keys(tenant: str, user: str, fingerprint: str, item_ids: list[str]) -> list[tuple[str, str, str, str]]:
    """The store keys of a read of ``item_ids``, every name checked: unique, in request order."""
    check_name("tenant", tenant), check_name("user", user), check_fingerprint(fingerprint)
    return list(dict.fromkeys((tenant, user, fingerprint, check_name("item", i)) for i in item_ids))


def item_path(root: Path, tenant: str, user: str, fingerprint: str, item: str) -> Path:
    """Where the store keeps an item's blob: its model's directory of the user, named by ``kvformat.blob_path``."""
    return blob_path(Path(root) / tenant / user / fingerprint[:FP_DIR_LEN], item)


def scan_blobs(root: Path) -> list[tuple[str, str, Path]]:
    """(tenant, user, path) of every blob in the store layout (depth 4); encoding-Job output one level up
    (``<root>/<tenant>/<user>/<item><SUFFIX>``) and temp files are ignored."""
    out = []
    for path in sorted(Path(root).glob(f"*/*/*/*{SUFFIX}")):
        tenant, user = path.parts[-4], path.parts[-3]
        if path.name.startswith(".") or not is_valid_id(tenant) or not is_valid_id(user):
            continue
        out.append((tenant, user, path))
    return out


def stage(path: Path, data: bytes | memoryview) -> Path:
    """A fsynced temp file of ``data`` next to ``path`` (kvformat.stage_file); StorageError when it cannot be."""
    try:
        return stage_file(path, data)
    except OSError as e:  # stage_file removed its temp file; the old blob (if any) is intact
        raise StorageError(f"cannot write {path}: {e.strerror or e}") from None


def write_recorded(path: Path, data: bytes | memoryview, record: Callable[[], None]) -> None:
    """Write a blob atomically, then ``record()`` it in the catalogue (``commit_staged``)."""
    commit_staged(path, stage(path, data), record)


def commit_staged(path: Path, staged: Path, record: Callable[[], None], *, sync_dir: bool = True) -> None:
    """Rename a staged blob into place, then ``record()`` it in the catalogue. Disk and catalogue never disagree: a
    failed write (a full disk) leaves the old blob; a catalogue failure after the rename puts the old blob back
    (kept as a hard link named like a temp file, so a crash in between leaves an orphan the next start removes)
    or removes the new one. Either failure is a StorageError. ``sync_dir=False``: the caller fsyncs the
    directory once after a batch."""
    keep = None
    if path.exists():
        keep = Path(tempfile.mktemp(prefix=f".{path.name}.keep.", suffix=TEMP_SUFFIX, dir=path.parent))
        os.link(path, keep)
    try:
        try:
            os.replace(staged, path)
            if sync_dir:
                fsync_dir(path.parent)
        except OSError as e:
            staged.unlink(missing_ok=True)
            raise StorageError(f"cannot write {path}: {e.strerror or e}") from None
        try:
            record()
        except sqlite3.Error as e:
            if keep is not None:
                os.replace(keep, path)
                keep = None
            else:
                path.unlink(missing_ok=True)
            raise StorageError(f"cannot record {path} in the catalogue ({e}); the blob was rolled back") from None
    finally:
        if keep is not None:
            keep.unlink(missing_ok=True)
