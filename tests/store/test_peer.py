"""Peer pulls (G4): a real NIXL UCX agent in another process on loopback; bounded failures."""

import os
import socket
import threading
import time

import pytest
import torch

from inferscale.errors import BlobCorruptError, NotFoundError, TransferError, UnsafePathError

from .helpers import FP, ITEMS, make_block


def test_pull_between_processes(open_store, peer_node):
    s = open_store(timeout_s=10.0)
    r = s.pull_from_peer("acme", "alice", peer_node, ["m1", "m3"])
    assert (r.blocks, r.tier) == (2, "dram") and r.bytes > 2 * make_block("m1", tokens=5).nbytes
    r = s.pull_from_peer("acme", "alice", peer_node)  # all of the user's items, idempotent for m1/m3
    assert r.blocks == len(ITEMS)
    got, st = s.get_many("acme", "alice", ITEMS, FP)
    assert st.tiers == {"gpu": 0, "dram": len(ITEMS), "disk": 0}
    for b in got:
        want = make_block(b.item_id, tokens=5)
        assert torch.equal(b.kv, want.kv) and torch.equal(b.embedding, want.embedding) and b.text == want.text
    # the pulled blocks are on this node's disk too, with their checksums catalogued
    s.dram.drop(lambda k: True)
    got, st = s.get_many("acme", "alice", ["m5"], FP)
    assert st.served == {"m5": "disk"} and torch.equal(got[0].kv, make_block("m5", tokens=5).kv)
    assert s.stats()["peer_pulls"] == len(ITEMS) + 2


def test_peer_is_tenant_scoped(open_store, peer_node):
    s = open_store()
    with pytest.raises(NotFoundError):
        s.pull_from_peer("other", "alice", peer_node)  # alice exists, but in tenant acme
    with pytest.raises(NotFoundError):
        s.pull_from_peer("acme", "bob", peer_node)  # bob exists, but in tenant other
    with pytest.raises(NotFoundError):
        s.pull_from_peer("acme", "alice", peer_node, ["m1", "nope"])
    with pytest.raises(NotFoundError):
        s.list("acme", "alice")  # nothing partial was stored


def test_unreachable_peer_fails_fast(open_store):
    s = open_store(timeout_s=1.0)
    with socket.socket() as probe:  # a port with nobody listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="unreachable"):
        s.pull_from_peer("acme", "alice", f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 3


def test_silent_peer_times_out(open_store):
    """A peer that accepts and never answers: a typed error after the timeout, never a hang."""
    s = open_store(timeout_s=1.0)
    srv = socket.create_server(("127.0.0.1", 0))
    conns = []
    threading.Thread(target=lambda: conns.append(srv.accept()), daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TransferError):
            s.pull_from_peer("acme", "alice", f"127.0.0.1:{srv.getsockname()[1]}")
        assert time.monotonic() - t0 < 4
    finally:
        srv.close()


def test_bad_peer_address_and_token(open_store, tmp_path):
    s = open_store()
    with pytest.raises(TransferError):
        s.pull_from_peer("acme", "alice", "no-port-here")
    a = open_store(tmp_path / "a", peer_port=0, peer_host="127.0.0.1", node="127.0.0.1", peer_secret="another-secret-0123456789")
    a.put("acme", "alice", make_block("m0"))
    with pytest.raises(TransferError, match="not authenticated"):
        s.pull_from_peer("acme", "alice", a.peer_address)


def test_corruption_in_peer_memory_detected(open_store, tmp_path):
    """Two agents in one process: bytes that change in the peer's DRAM fail the puller's checksum."""
    a = open_store(tmp_path / "a", peer_port=0, peer_host="127.0.0.1", node="127.0.0.1")
    for it in ("m0", "m1"):
        a.put("acme", "alice", make_block(it))
    e = a.dram.acquire(("acme", "alice", FP, "m1"))
    a.arena.np[e.offset + e.size - 100] ^= 0xFF  # flip a kv byte in the peer's arena
    a.dram.release(e)
    b = open_store(tmp_path / "b")
    with pytest.raises(BlobCorruptError, match="m1") as err:
        b.pull_from_peer("acme", "alice", a.peer_address)
    assert err.value.item_ids == ["m1"]
    got, _ = b.get_many("acme", "alice", ["m0"], FP)  # the intact block was kept
    assert torch.equal(got[0].kv, make_block("m0").kv)
    with pytest.raises(NotFoundError):
        b.get_many("acme", "alice", ["m1"], FP)


def test_lease_ends_once_written(open_store, tmp_path):
    """The peer holds pulled blocks (no eviction mid-transfer) only until its WRITE into the puller is done."""
    a = open_store(tmp_path / "a", peer_port=0, peer_host="127.0.0.1", node="127.0.0.1")
    for it in ("m0", "m1", "m2"):
        a.put("acme", "alice", make_block(it))
    b = open_store(tmp_path / "b")
    assert b.pull_from_peer("acme", "alice", a.peer_address, ["m0", "m2"]).blocks == 2
    deadline = time.monotonic() + 3
    while a.peer_service.leases.leases and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not a.peer_service.leases.leases
    e = a.dram.acquire(("acme", "alice", FP, "m0"))
    assert e.refs == 1  # only ours: the lease's reference is gone
    a.dram.release(e)


def test_peer_imports_job_dir_and_full_disk_keeps_slots(open_store, tmp_path, monkeypatch):
    from inferscale.errors import StorageError
    from inferscale.kvformat import save_block

    job = tmp_path / "hostpath" / "acme" / "alice"  # an encoding Job's output on the peer's node
    for it in ("m0", "m1"):
        save_block(make_block(it), job)
    a = open_store(tmp_path / "a", peer_port=0, peer_host="127.0.0.1", node="127.0.0.1",
                   job_root=tmp_path / "hostpath")
    b = open_store(tmp_path / "b")
    with pytest.raises(UnsafePathError):  # a directory of another tenant/user is refused
        b.pull_from_peer("acme", "bob", a.peer_address, ["m0"], source_dir=str(job))
    r = b.pull_from_peer("acme", "alice", a.peer_address, ["m0"], source_dir=str(job))  # the peer imports m0
    assert (r.blocks, r.total_blocks) == (1, 1) and [i.item_id for i in a.list("acme", "alice")] == ["m0"]
    a.import_dir("acme", "alice", job, ["m1"])
    import inferscale.kvformat as kvformat

    def enospc(*_a):
        raise OSError(28, "No space left on device")

    real_fsync = os.fsync
    monkeypatch.setattr(kvformat.os, "fsync", enospc)
    used = b.stats()["dram_bytes"]
    with pytest.raises(StorageError):  # this node's disk is full
        b.pull_from_peer("acme", "alice", a.peer_address, ["m1"], source_dir=str(job))
    monkeypatch.setattr(kvformat.os, "fsync", real_fsync)
    assert b.stats()["dram_bytes"] == used  # nothing leaked from the arena
    r = b.pull_from_peer("acme", "alice", a.peer_address, ["m0", "m1"], source_dir=str(job))
    assert (r.blocks, r.total_blocks, r.total_tokens) == (2, 2, 8)
    got, _ = b.get_many("acme", "alice", ["m1"], FP)
    assert torch.equal(got[0].kv, make_block("m1").kv)
