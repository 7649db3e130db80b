"""Blob format: round trip, checksums, fingerprints, atomic writes."""

import os

import pytest
import torch

import tiny_models as tm
from inferscale.kvformat import SUFFIX
from inferscale.engine import MemoryItem
from inferscale.errors import BlobCorruptError, FingerprintMismatchError
from inferscale.kvformat import blob_path, decode_blob, encode_blob, load_block, save_block


@pytest.fixture(scope="module")
def engine():
    return tm.engine("llama")


@pytest.fixture(scope="module")
def block(engine):
    return engine.encode([MemoryItem("m1", "caroline went to paris", timestamp="may 2023")])[0]


def test_round_trip(engine, block, tmp_path):
    block.embedding = torch.arange(4, dtype=torch.float32)
    path = save_block(block, tmp_path)
    back = load_block(path, expect_fingerprint=engine.loaded.fingerprint, expect_prefix=engine.prefix_sha256)
    assert back.item_id == "m1" and back.timestamp == "may 2023" and back.token_ids == block.token_ids
    assert torch.equal(back.kv, block.kv) and torch.equal(back.embedding, block.embedding)
    assert engine.load_blocks(tmp_path)[0].item_id == "m1"


def test_corrupted_blob_raises(block, tmp_path):
    path = save_block(block, tmp_path)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # flip a bit inside the tensor bytes
    path.write_bytes(bytes(data))
    with pytest.raises(BlobCorruptError, match="checksum"):
        load_block(path)
    path.write_bytes(bytes(data[:100]))  # truncated
    with pytest.raises(BlobCorruptError, match=path.name):
        load_block(path)
    with pytest.raises(BlobCorruptError, match="cannot read"):
        load_block(tmp_path / f"missing{SUFFIX}")


def test_other_model_blob_is_refused(block, tmp_path):
    other = tm.engine("qwen2")
    path = save_block(block, tmp_path)
    with pytest.raises(FingerprintMismatchError):
        other.load_blocks([path])
    with pytest.raises(FingerprintMismatchError):
        other.prefill(other.question_ids("where?"), [block], "kv")  # never injected, even from DRAM


def test_fingerprint_depends_on_weights():
    a, b = tm.engine("llama", seed=0), tm.engine("llama", seed=1)
    assert a.loaded.fingerprint != b.loaded.fingerprint
    assert a.loaded.fingerprint == tm.engine("llama", seed=0).loaded.fingerprint


def test_failed_write_keeps_old_file(block, tmp_path, monkeypatch):
    path = save_block(block, tmp_path)
    before = path.read_bytes()

    def full_disk(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", lambda fd: full_disk(fd, b""))
    with pytest.raises(OSError):
        save_block(block, tmp_path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


def test_blob_bytes_round_trip_and_garbage(block):
    assert decode_blob(encode_blob(block)).token_ids == block.token_ids
    with pytest.raises(BlobCorruptError):
        decode_blob(b"not a blob at all")
    assert blob_path("d", "x").name == f"x{SUFFIX}"
