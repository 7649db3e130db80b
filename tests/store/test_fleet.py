"""The fleet path (inferscale/store/fleet.py): a pod lacking a user finds a holder (its node's Job dir, else a peer the
operator published), pulls exactly the top-k blocks over NIXL UCX from a real peer process, and never answers a
miss silently."""

import pytest
import torch

from inferscale.errors import InvalidInputError, NotFoundError, TransferError
from inferscale.kvformat import SUFFIX, encode_blob
from inferscale.store.fleet import Fleet
from inferscale.store import KVStore
from inferscale.bench.node import child_process, serve_node

from .helpers import FP, ITEMS, PEER_SECRET, PEER_TLS, make_block


def test_pulls_exactly_the_needed_blocks_from_a_peer(open_store, peer_node, tmp_path):
    store = open_store(timeout_s=10.0)
    fleet = Fleet(store)
    fleet.set_peers([peer_node])
    ids, matrix = fleet.embeddings("acme", "alice", FP)
    assert sorted(ids) == ITEMS and tuple(matrix.shape) == (6, 16)
    want = {i: make_block(i, tokens=5) for i in ITEMS}
    assert torch.equal(matrix[ids.index("m2")], want["m2"].embedding)
    got = fleet.blocks("acme", "alice", ["m1", "m3"], FP)
    assert (got.pulled_blocks, got.peer) == (2, peer_node) and got.pulled_bytes > 0
    (kept,) = [s for _, s in store.peer_sessions.kept[(peer_node, store.peer_secret)]]
    assert kept.seq == 2  # the index, then one pull with its sizes (no locate round trip)
    assert [b.item_id for b in got.blocks] == ["m1", "m3"]
    assert all(torch.equal(b.kv, want[b.item_id].kv) for b in got.blocks)
    assert sorted(i.item_id for i in store.list("acme", "alice")) == ["m1", "m3"]  # only those two moved
    again = fleet.blocks("acme", "alice", ["m3", "m1"], FP)  # now cached here: no second pull
    assert again.pulled_blocks == 0 and again.stats.tiers["dram"] == 2
    # A restart must not take the local subset for the whole list: the index comes from the peer again.
    restarted = Fleet(store)
    with pytest.raises(NotFoundError):  # a partial user with no peer known yet: a miss, not the subset
        restarted.embeddings("acme", "alice", FP)
    restarted.set_peers([peer_node])
    ids2, _ = restarted.embeddings("acme", "alice", FP)
    assert sorted(ids2) == ITEMS


def test_miss_everywhere_is_a_typed_error(open_store, peer_node):
    fleet = Fleet(open_store(timeout_s=10.0))
    with pytest.raises(NotFoundError, match="no memories on this pod and it knows no peer"):
        fleet.embeddings("acme", "alice", FP)
    fleet.set_peers([peer_node])
    with pytest.raises(NotFoundError, match="any of its 1 peer"):
        fleet.embeddings("acme", "bob", FP)  # no such user anywhere
    with pytest.raises(NotFoundError):
        fleet.embeddings("other", "alice", FP)  # alice exists, but in tenant acme: the peer is tenant-scoped


def test_an_unreachable_peer_is_an_error_not_a_user_without_memories(open_store, peer_node):
    import socket

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    fleet = Fleet(open_store(timeout_s=2.0))
    fleet.set_peers([f"127.0.0.1:{free_port()}"])  # nothing listens there: it may have been alice's holder
    with pytest.raises(TransferError, match="could not be asked"):
        fleet.embeddings("acme", "alice", FP)
    fleet.set_peers([f"127.0.0.1:{free_port()}", peer_node])  # the next peer answers
    ids, _ = fleet.embeddings("acme", "alice", FP)
    assert sorted(ids) == ITEMS


def test_imports_its_nodes_job_dir(open_store, tmp_path):
    job_root = tmp_path / "hostpath"
    d = job_root / "acme" / "alice"
    d.mkdir(parents=True)
    for i in ITEMS[:3]:
        (d / f"{i}{SUFFIX}").write_bytes(encode_blob(make_block(i)))
    store = open_store(job_root=job_root, nixl=False)
    ids, _ = Fleet(store).embeddings("acme", "alice", FP)
    assert sorted(ids) == ITEMS[:3]
    assert sorted(i.item_id for i in store.list("acme", "alice")) == ITEMS[:3]


def test_forget_drops_the_remote_index(open_store, peer_node):
    store = open_store(timeout_s=10.0)
    fleet = Fleet(store)
    fleet.set_peers([peer_node])
    fleet.embeddings("acme", "alice", FP)
    fleet.blocks("acme", "alice", ["m0"], FP)
    store.purge("acme", "alice", None)
    fleet.forget("acme", "alice")
    assert fleet.indexes == {} and not fleet._partial("acme", "alice")


def test_bad_peer_addresses_are_refused(open_store):
    fleet = Fleet(open_store(nixl=False))
    for bad in (["nohost"], ["h:notaport"], ["h:1"] * 300):
        with pytest.raises(InvalidInputError):
            fleet.set_peers(bad)


def test_a_partial_holder_is_never_served_as_the_whole_list(open_store, peer_node, tmp_path):
    """Pod B pulled 2 of 6 blocks on demand; pod C asking B for the index must not get those 2 as the list."""
    from inferscale.store.pulling import peer_index
    from inferscale.store.serving import partial_marker

    b = open_store(tmp_path / "b", timeout_s=10.0, peer_port=0, peer_host="127.0.0.1")
    fb = Fleet(b)
    fb.set_peers([peer_node])
    fb.embeddings("acme", "alice", FP)
    fb.blocks("acme", "alice", ["m1", "m3"], FP)
    assert partial_marker(b.root, "acme", "alice").exists()
    c = open_store(tmp_path / "c", timeout_s=10.0)
    with pytest.raises(NotFoundError, match="only part"):
        peer_index(c, "acme", "alice", b.peer_address, FP)
    fc = Fleet(c)
    fc.set_peers([b.peer_address, peer_node])  # B first: it is skipped, the full holder answers
    ids, _ = fc.embeddings("acme", "alice", FP)
    assert sorted(ids) == ITEMS and fc.indexes[("acme", "alice", FP)].peer == peer_node


def test_a_peer_on_the_job_node_serves_its_job_dir(open_store, tmp_path):
    """The peer holds nothing in its store, but the Job ran on its node: the index op imports its own Job dir
    (no path on the wire), and exactly the top-k blocks are then leased from it."""
    job_root = tmp_path / "node1-kv"
    d = job_root / "acme" / "carol"
    d.mkdir(parents=True)
    for i in ITEMS:
        (d / f"{i}{SUFFIX}").write_bytes(encode_blob(make_block(i, tokens=5)))
    options = {"dram_budget_bytes": 8 << 20, "timeout_s": 10.0, "peer_secret": PEER_SECRET, "peer_tls": PEER_TLS, "job_root": str(job_root)}
    with child_process(serve_node, str(tmp_path / "node1-store"), options) as info:
        store = open_store(timeout_s=10.0)
        fleet = Fleet(store)
        fleet.set_peers([info["peer"]])
        ids, _ = fleet.embeddings("acme", "carol", FP)
        assert sorted(ids) == ITEMS
        got = fleet.blocks("acme", "carol", ["m4"], FP)
        assert got.pulled_blocks == 1 and torch.equal(got.blocks[0].kv, make_block("m4", tokens=5).kv)


def test_a_holder_that_vanished_is_looked_up_again(open_store, tmp_path):
    root = tmp_path / "gone"
    with KVStore(root, dram_budget_bytes=8 << 20, nixl=False) as s:
        for it in ITEMS:
            s.put("acme", "alice", make_block(it, tokens=5))
    store = open_store(timeout_s=3.0)
    fleet = Fleet(store)
    with child_process(serve_node, str(root), {"dram_budget_bytes": 8 << 20, "timeout_s": 10.0, "peer_secret": PEER_SECRET, "peer_tls": PEER_TLS}) as info:
        fleet.set_peers([info["peer"]])
        fleet.embeddings("acme", "alice", FP)
    from inferscale.errors import TransferError

    with pytest.raises(TransferError):
        fleet.blocks("acme", "alice", ["m1"], FP)
    assert fleet.indexes == {}  # the next request asks the peers again instead of the dead holder
