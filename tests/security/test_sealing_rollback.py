"""Rolling a sealed store back (inferscale/store/versions.py): someone who can write the node's disk restores an
older sealed version of an item (it opens: same tenant, user, item and model) and edits or rebuilds the
catalogue to make it current; or reads the catalogue for what it tells about memories."""

from __future__ import annotations

import sqlite3
import stat

import pytest
import torch

from inferscale import sealing
from inferscale.errors import BlobCorruptError
from inferscale.store import KVStore
from inferscale.store.layout import CATALOGUE_NAME

from store.helpers import FP, make_block  # tests/store/helpers.py (tests/ is on sys.path)


@pytest.fixture
def sealed(tmp_path):
    path = tmp_path / "kek"
    path.write_text(sealing.new_key_line("k1"))
    path.chmod(0o600)  # a KEK file others can read is refused
    stores = []

    def open_store(**kw):
        s = KVStore(tmp_path / "kv", dram_budget_bytes=8 << 20, nixl=False,
                    keyring=sealing.Keyring.load(path), **kw)
        stores.append(s)
        return s

    yield open_store
    for s in stores:
        s.close()


def _two_versions(s: KVStore, tmp_path) -> tuple[str, bytes]:
    """Put v1 of acme/alice/m0, keep a copy of its sealed file, put v2. Returns (blob path, the v1 file)."""
    s.put("acme", "alice", make_block("m0", version=1), cache=False)
    path = s.list("acme", "alice")[0].path
    old = open(path, "rb").read()
    s.put("acme", "alice", make_block("m0", version=2), cache=False)
    return path, old


def _sql(s: KVStore, query: str, args: tuple = ()) -> list:
    db = sqlite3.connect(s.root / CATALOGUE_NAME)
    try:
        with db:
            return db.execute(query, args).fetchall()
    finally:
        db.close()


def _version(s: KVStore) -> int:
    got, _ = s.get_many("acme", "alice", ["m0"], FP)
    return int(got[0].kv[0, 0, 0, 0, 0])


def _plain_sha_of_v1(tmp_path) -> str:
    with KVStore(tmp_path / "plain", dram_budget_bytes=8 << 20, nixl=False) as plain:
        return plain.put("acme", "alice", make_block("m0", version=1)).sha256


@pytest.mark.parametrize("edit", ["none", "sha256", "generation"])
def test_an_older_version_restored_on_disk_is_refused(sealed, tmp_path, edit):
    """v1's sealed file restored over v2, the row left as is, or its sha256 (or generation) edited to v1's. Before:
    the blob's AAD named no version and the catalogue was not authenticated, so the sha256 edit served v1 again."""
    s = sealed()
    path, old = _two_versions(s, tmp_path)
    s.close()
    open(path, "wb").write(old)
    if edit == "sha256":
        _sql(s, "UPDATE items SET sha256=?", (_plain_sha_of_v1(tmp_path),))
    elif edit == "generation":
        _sql(s, "UPDATE items SET generation=?", (sealing.parse_sealed(old, source=path).generation,))
    s = sealed()
    with pytest.raises(BlobCorruptError, match="m0"):
        s.get_many("acme", "alice", ["m0"], FP)


def test_an_older_version_is_refused_when_the_catalogue_is_rebuilt(sealed, tmp_path):
    """Before: a rebuild trusted whatever sealed blob the disk held."""
    s = sealed()
    path, old = _two_versions(s, tmp_path)
    assert _version(s) == 2
    open(path, "wb").write(old)
    assert s.rebuild() == 0  # v1 is older than the row this store wrote: not catalogued
    s.dram.invalidate(("acme", "alice", FP, "m0"))
    with pytest.raises(BlobCorruptError, match="m0"):
        s.get_many("acme", "alice", ["m0"], FP)
    s.put("acme", "alice", make_block("m0", version=3), cache=False)  # a new put is current again
    assert _version(s) == 3
    assert s.rebuild() == 1 and _version(s) == 3


def test_catalogue_files_are_0600_in_0700_directories(sealed):
    s = sealed()
    s.put("acme", "alice", make_block("m0"), cache=False)
    for name in (CATALOGUE_NAME, f"{CATALOGUE_NAME}-wal", f"{CATALOGUE_NAME}-shm"):
        assert stat.S_IMODE((s.root / name).stat().st_mode) == 0o600, name
    blob = s.list("acme", "alice")[0].path
    d = type(s.root)(blob).parent
    while d != s.root.parent:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        d = d.parent


def test_embeddings_are_not_in_clear_in_the_catalogue(sealed):
    """Before: each memory's embedding sat in SQLite in clear: an equality oracle for a guessed memory text."""
    s = sealed()
    block = make_block("m0")
    s.put("acme", "alice", block, cache=False)
    plain = block.embedding.to(torch.float32).numpy().tobytes()
    stored = _sql(s, "SELECT embedding FROM items")[0][0]
    assert plain not in stored
    for name in (CATALOGUE_NAME, f"{CATALOGUE_NAME}-wal"):
        assert plain[:32] not in (s.root / name).read_bytes(), name
    ids, matrix = s.embeddings("acme", "alice", FP)
    assert ids == ["m0"] and torch.equal(matrix[0], block.embedding.to(torch.float32))


def test_rotation_reseals_rows_so_the_old_key_can_be_dropped(tmp_path):
    kek = tmp_path / "kek"
    kek.write_text(sealing.new_key_line("k1"))
    kek.chmod(0o600)
    s = KVStore(tmp_path / "kv", dram_budget_bytes=8 << 20, nixl=False, keyring=sealing.Keyring.load(kek))
    block = make_block("m0")
    s.put("acme", "alice", block, cache=False)
    s.close()
    kek.write_text(sealing.new_key_line("k2") + kek.read_text())
    s = KVStore(tmp_path / "kv", dram_budget_bytes=8 << 20, nixl=False, keyring=sealing.Keyring.load(kek))
    assert s.rotate_keys() == 1
    s.close()
    kek.write_text(kek.read_text().splitlines(keepends=True)[0])  # drop k1
    s = KVStore(tmp_path / "kv", dram_budget_bytes=8 << 20, nixl=False, keyring=sealing.Keyring.load(kek))
    try:
        _, matrix = s.embeddings("acme", "alice", FP)
        assert torch.equal(matrix[0], block.embedding.to(torch.float32))
        got, _ = s.get_many("acme", "alice", ["m0"], FP)
        assert torch.equal(got[0].kv, block.kv)
    finally:
        s.close()
