"""The catalogue's memory records (what the fetch planner recomputes from without reading a blob), the store's
residency answer (``locate``), per-tier fetch costs in FetchStats, and a throttled disk that really reads slower."""

from __future__ import annotations

import sqlite3
import time

import pytest

from inferscale import sealing
from inferscale.store.throttle import ThrottledReader

from .helpers import FP, make_block


@pytest.fixture
def keyring(tmp_path):
    path = tmp_path / "kek"
    path.write_text(sealing.new_key_line("k1"))
    path.chmod(0o600)
    return sealing.Keyring.load(path)


@pytest.mark.parametrize("sealed", [True, False])
def test_a_put_records_each_memorys_text_and_token_ids(open_store, keyring, sealed):
    s = open_store(keyring=keyring if sealed else None)
    blocks = [make_block(f"m{i}", tokens=3 + i) for i in range(3)]
    for b in blocks:
        s.put("acme", "alice", b)
    got = s.memory_records("acme", "alice", ["m0", "m2", "nope"], FP)
    assert sorted(got) == ["m0", "m2"]
    for b in (blocks[0], blocks[2]):
        r = got[b.item_id]
        assert (r.text, r.timestamp, list(r.token_ids)) == (b.text, b.timestamp, b.token_ids)
    assert s.memory_records("globex", "alice", ["m0"], FP) == {}  # another tenant's name reaches nothing


def test_records_are_sealed_and_bound_to_their_row(open_store, keyring, tmp_path):
    s = open_store(keyring=keyring)
    s.put("acme", "alice", make_block("m0"))
    s.put("acme", "alice", make_block("m1"))
    db = sqlite3.connect(tmp_path / "kv" / "catalogue.sqlite")
    stored = dict(db.execute("SELECT item, memory FROM items").fetchall())
    assert b"m0 v0" not in stored["m0"]  # the text is not in the catalogue in the clear
    # A record moved to another row does not open there: that item is left out (it would be fetched instead).
    db.execute("UPDATE items SET memory=? WHERE item='m1'", (stored["m0"],))
    db.commit()
    db.close()
    assert sorted(s.memory_records("acme", "alice", ["m0", "m1"], FP)) == ["m0"]


def test_records_survive_a_rebuild_and_a_key_rotation(open_store, keyring, tmp_path):
    s = open_store(keyring=keyring)
    s.put("acme", "alice", make_block("m0"))
    s.close()
    for f in (tmp_path / "kv").glob("catalogue.sqlite*"):
        f.unlink()
    s = open_store(keyring=keyring)  # rebuilt from the blobs
    assert s.memory_records("acme", "alice", ["m0"], FP)["m0"].text == "m0 v0"
    kek = tmp_path / "kek"
    kek.write_text(sealing.new_key_line("k2") + kek.read_text())
    s.keyring = s.disk.keyring = s.disk.seal.keyring = sealing.Keyring.load(kek)
    s.rotate_keys()
    kek.write_text(kek.read_text().splitlines(keepends=True)[0])  # the old key dropped
    s.close()
    s = open_store(keyring=sealing.Keyring.load(kek))
    assert s.memory_records("acme", "alice", ["m0"], FP)["m0"].text == "m0 v0"


def test_locate_says_where_each_block_is_and_moves_nothing(open_store):
    s = open_store()
    s.put("acme", "alice", make_block("hot"))
    s.put("acme", "alice", make_block("cold"), cache=False)
    where = s.locate("acme", "alice", ["hot", "cold", "absent"], FP)
    assert {i: r.tiers[0] for i, r in where.items()} == {"hot": "dram", "cold": "disk"}
    assert s.locate("acme", "alice", ["cold"], FP)["cold"].tiers[0] == "disk"  # asking did not load it


def test_fetch_stats_split_time_and_bytes_by_tier(open_store):
    s = open_store()
    s.put("acme", "alice", make_block("hot"))
    s.put("acme", "alice", make_block("cold"), cache=False)
    _, stats = s.get_many("acme", "alice", ["hot", "cold"], FP)
    assert stats.tier_bytes["disk"] == stats.bytes_read > 0 and stats.tier_bytes["dram"] > 0
    assert stats.tier_seconds["disk"] > 0 and stats.tier_seconds["dram"] >= 0
    assert sum(stats.tier_seconds.values()) <= stats.seconds


def test_a_throttled_disk_reads_the_real_blob_at_the_set_rate(open_store):
    s = open_store()
    s.put("acme", "alice", make_block("m0"), cache=False)
    size = s.list("acme", "alice")[0].size
    s.disk_reader = ThrottledReader(bytes_per_s=size * 4, burst=1)  # one blob: ~0.25 s
    t0 = time.perf_counter()
    blocks, stats = s.get_many("acme", "alice", ["m0"], FP)
    assert time.perf_counter() - t0 >= 0.2 and stats.tiers["disk"] == 1
    assert blocks[0].text == "m0 v0"  # the bytes read are the blob's: it verified and opened
