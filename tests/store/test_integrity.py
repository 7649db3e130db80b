"""Checksums on every read from disk; a full disk leaves no partial file."""

import errno
import os
from pathlib import Path

import pytest
import torch

from inferscale.kvformat import SUFFIX
from inferscale.errors import BlobCorruptError, StorageError

from .helpers import FP, make_block


def _flip_byte_in_kv(path: str) -> None:
    data = bytearray(Path(path).read_bytes())
    data[-200] ^= 0xFF  # inside the tensor bytes, after the header
    Path(path).write_bytes(bytes(data))


def test_corrupted_file_detected_and_marked(open_store):
    s = open_store()
    for i in range(3):
        s.put("acme", "alice", make_block(f"m{i}"), cache=False)
    _flip_byte_in_kv(s.list("acme", "alice")[1].path)
    with pytest.raises(BlobCorruptError, match="m1") as e:
        s.get_many("acme", "alice", ["m0", "m1", "m2"], FP)
    assert e.value.item_ids == ["m1"]
    info = {i.item_id: i for i in s.list("acme", "alice")}
    assert info["m1"].corrupt and not info["m0"].corrupt
    assert "dram" not in info["m1"].tiers and "dram" in info["m0"].tiers  # the good ones were still loaded
    with pytest.raises(BlobCorruptError):  # refused straight from the catalogue now
        s.get_many("acme", "alice", ["m1"], FP)
    got, _ = s.get_many("acme", "alice", ["m0", "m2"], FP)
    assert torch.equal(got[1].kv, make_block("m2").kv)
    s.put("acme", "alice", make_block("m1", version=2))  # re-encode clears the flag
    got, _ = s.get_many("acme", "alice", ["m1"], FP)
    assert got[0].text == "m1 v2"


def test_truncated_or_missing_file_detected(open_store):
    s = open_store()
    for i in range(2):
        s.put("acme", "alice", make_block(f"m{i}"), cache=False)
    p0, p1 = (i.path for i in s.list("acme", "alice"))
    Path(p0).write_bytes(Path(p0).read_bytes()[:1000])
    os.unlink(p1)
    with pytest.raises(BlobCorruptError) as e:
        s.get_many("acme", "alice", ["m0", "m1"], FP)
    assert e.value.item_ids == ["m0", "m1"]


def test_swapped_blob_detected(open_store):
    """A valid blob of another item under this item's name fails the catalogue checksum."""
    s = open_store()
    for i in range(2):
        s.put("acme", "alice", make_block(f"m{i}"), cache=False)
    p0, p1 = (i.path for i in s.list("acme", "alice"))
    Path(p0).write_bytes(Path(p1).read_bytes())
    with pytest.raises(BlobCorruptError, match="m0"):
        s.get_many("acme", "alice", ["m0"], FP)


def test_full_disk_leaves_no_partial_file(open_store, monkeypatch):
    s = open_store()
    s.put("acme", "alice", make_block("m0", version=1))
    before = s.list("acme", "alice")[0]
    directory = Path(before.path).parent
    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    import inferscale.kvformat as kvformat

    real_fsync = os.fsync
    monkeypatch.setattr(kvformat.os, "fsync", enospc)
    with pytest.raises(StorageError, match="No space left"):
        s.put("acme", "alice", make_block("m0", version=2))
    with pytest.raises(StorageError):
        s.put("acme", "alice", make_block("new"))
    monkeypatch.setattr(kvformat.os, "fsync", real_fsync)
    assert sorted(p.name for p in directory.iterdir()) == [f"m0{SUFFIX}"]  # no temp, no partial file
    after = s.list("acme", "alice")
    assert [i.item_id for i in after] == ["m0"] and after[0].sha256 == before.sha256
    got, _ = s.get_many("acme", "alice", ["m0"], FP)
    assert got[0].text == "m0 v1"
    s.put("acme", "alice", make_block("m0", version=3))  # writes work again once there is space


def test_catalogue_failure_after_the_write_rolls_the_blob_back(open_store, monkeypatch):
    """SQLite fails after the blob was renamed into place: the old blob comes back (a new item's file goes), so
    disk and catalogue agree at once, not at the next read's 503."""
    import sqlite3

    s = open_store()
    s.put("acme", "alice", make_block("m0", version=1))
    directory = Path(s.list("acme", "alice")[0].path).parent

    def broken(*a, **k):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(s.catalogue, "upsert", broken)
    with pytest.raises(StorageError, match="rolled back"):
        s.put("acme", "alice", make_block("m0", version=2))
    with pytest.raises(StorageError, match="rolled back"):
        s.put("acme", "alice", make_block("m1"))
    monkeypatch.undo()
    assert sorted(p.name for p in directory.iterdir()) == [f"m0{SUFFIX}"]  # no new file, no kept link
    got, _ = s.get_many("acme", "alice", ["m0"], FP)
    assert got[0].text == "m0 v1"  # the file the catalogue describes, checksum and all


def test_an_item_marked_corrupt_is_not_served_from_dram(open_store):
    """A DRAM hit does not ask the catalogue, so marking an item corrupt (a peer sent a bad copy of it, a
    concurrent load failed its check) must drop its cached copy: the next read fails like a disk read would."""
    s = open_store()
    s.put("acme", "alice", make_block("m0"))
    s.put("acme", "alice", make_block("m1"))
    _, stats = s.get_many("acme", "alice", ["m0", "m1"], FP)
    assert stats.tiers["dram"] == 2
    with pytest.raises(BlobCorruptError):
        s.raise_corrupt("acme", "alice", ["m1"], mark=True)
    with pytest.raises(BlobCorruptError, match="m1"):
        s.get_many("acme", "alice", ["m0", "m1"], FP)
    (b,), stats = s.get_many("acme", "alice", ["m0"], FP)
    assert stats.served == {"m0": "dram"} and torch.equal(b.kv, make_block("m0").kv)
