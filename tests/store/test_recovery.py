"""The SQLite catalogue survives restarts and is rebuilt from the disk tier when lost."""

import os

import torch

from inferscale.kvformat import SUFFIX

from .helpers import FP, make_block


def _fill(s):
    for u in ("alice", "bob"):
        for i in range(3):
            s.put("acme", u, make_block(f"{u}{i}"))
    s.put("other", "alice", make_block("x0"))


def test_restart_recovers_from_sqlite(open_store, tmp_path):
    s = open_store(tmp_path / "kv")
    _fill(s)
    s.pin("acme", "alice", ["alice1"])
    before = {(i.item_id, i.sha256, i.size) for i in s.list("acme", "alice")}
    s.close()
    s2 = open_store(tmp_path / "kv")
    assert {(i.item_id, i.sha256, i.size) for i in s2.list("acme", "alice")} == before
    info = {i.item_id: i for i in s2.list("acme", "alice")}
    assert info["alice1"].pinned and not info["alice0"].pinned
    assert all(i.tiers == ["disk"] for i in info.values())  # residency is not carried over a restart
    got, st = s2.get_many("acme", "bob", ["bob2"], FP)
    assert st.served == {"bob2": "disk"} and torch.equal(got[0].kv, make_block("bob2").kv)
    assert s2.users("other") == ["alice"]


def test_missing_catalogue_rebuilt_from_disk(open_store, tmp_path):
    s = open_store(tmp_path / "kv")
    _fill(s)
    emb_before = s.embeddings("acme", "bob", FP)
    s.close()
    for suffix in ("", "-wal", "-shm"):
        p = tmp_path / "kv" / f"catalogue.sqlite{suffix}"
        if p.exists():
            os.unlink(p)
    (tmp_path / "kv" / "acme" / "alice" / f"stray{SUFFIX}").write_bytes(b"job output, not store layout")
    s2 = open_store(tmp_path / "kv")
    assert s2.users("acme") == ["alice", "bob"] and [i.item_id for i in s2.list("other", "alice")] == ["x0"]
    ids, emb = s2.embeddings("acme", "bob", FP)
    assert ids == emb_before[0] and torch.equal(emb, emb_before[1])
    got, _ = s2.get_many("acme", "alice", ["alice0", "alice2"], FP)
    assert torch.equal(got[1].kv, make_block("alice2").kv)


def test_unreadable_catalogue_rebuilt(open_store, tmp_path):
    s = open_store(tmp_path / "kv")
    _fill(s)
    s.close()
    for suffix in ("-wal", "-shm"):
        p = tmp_path / "kv" / f"catalogue.sqlite{suffix}"
        if p.exists():
            os.unlink(p)
    (tmp_path / "kv" / "catalogue.sqlite").write_bytes(b"this is not a database" * 100)
    s2 = open_store(tmp_path / "kv")
    assert len(s2.list("acme", "bob")) == 3
