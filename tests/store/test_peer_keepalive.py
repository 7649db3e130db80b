"""Pulls keep their peer session open for the next pull (inferscale/store/peer_pool.py), and the owner keeps a
puller's NIXL view between writes (inferscale/store/nixl_transport.py), both bounded; a pull that fails closes
its session, so the owner's lease ends with it."""

import time

import pytest
import torch

from inferscale.errors import QuotaExceededError
from inferscale.store import nixl_transport
from inferscale.store.peer_pool import PeerSessions

from .helpers import FP, make_block


@pytest.fixture
def owner_and_puller(open_store, tmp_path):
    def make(owner_timeout_s: float = 5.0):
        a = open_store(tmp_path / "a", peer_port=0, peer_host="127.0.0.1", node="127.0.0.1",
                       timeout_s=owner_timeout_s)
        for it in ("m0", "m1", "m2"):
            a.put("acme", "alice", make_block(it))
        return a, open_store(tmp_path / "b")
    return make


def _kept(store, peer):
    return [s for _, s in store.peer_sessions.kept.get((peer, store.peer_secret), [])]


def test_pulls_reuse_one_session(owner_and_puller):
    a, b = owner_and_puller()
    assert b.pull_from_peer("acme", "alice", a.peer_address, ["m0"]).blocks == 1
    (first,) = _kept(b, a.peer_address)
    assert b.pull_from_peer("acme", "alice", a.peer_address, ["m1", "m2"]).blocks == 2
    (second,) = _kept(b, a.peer_address)
    assert second is first and second.seq == 4  # locate + write, twice, in one session
    got, _ = b.get_many("acme", "alice", ["m0", "m1", "m2"], FP)
    assert [g.item_id for g in got] == ["m0", "m1", "m2"]


def test_a_kept_session_the_owner_closed_is_replaced(owner_and_puller):
    """The owner drops idle sessions after its timeout (0.5 s here); the puller's kept one then fails on first
    use and the pull goes on in a new session."""
    a, b = owner_and_puller(owner_timeout_s=0.5)
    assert b.pull_from_peer("acme", "alice", a.peer_address, ["m0"]).blocks == 1
    (stale,) = _kept(b, a.peer_address)
    time.sleep(1.0)  # past the owner's timeout, within the pool's idle limit
    assert b.pull_from_peer("acme", "alice", a.peer_address, ["m1"]).blocks == 1
    (fresh,) = _kept(b, a.peer_address)
    assert fresh is not stale and fresh.seq == 2


def test_a_failed_pull_closes_its_session_and_the_lease_ends(owner_and_puller, monkeypatch):
    a, b = owner_and_puller()
    assert b.pull_from_peer("acme", "alice", a.peer_address, ["m0"]).blocks == 1

    def full(*_a, **_k):
        raise QuotaExceededError("DRAM full")

    monkeypatch.setattr(b.dram, "reserve", full)
    with pytest.raises(QuotaExceededError):
        b.pull_from_peer("acme", "alice", a.peer_address, ["m1"])
    assert _kept(b, a.peer_address) == []  # closed, not kept
    deadline = time.monotonic() + 3
    while a.peer_service.leases.leases and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not a.peer_service.leases.leases  # the owner ended the lease with the session


def test_kept_sessions_are_bounded_per_peer_and_in_idle_time(owner_and_puller):
    a, b = owner_and_puller()
    pool = PeerSessions(idle_s=0.2, per_peer=1, tls=b.peer_tls)
    s1, kept1 = pool.take(a.peer_address, b.peer_secret, 5.0)
    s2, kept2 = pool.take(a.peer_address, b.peer_secret, 5.0)
    assert not kept1 and not kept2
    pool.give_back(s1, 2)
    pool.give_back(s2, 2)  # over per_peer: closed
    assert s2.sock.fileno() == -1 and s1.sock.fileno() != -1
    again, kept = pool.take(a.peer_address, b.peer_secret, 5.0)
    assert kept and again is s1
    pool.give_back(again, 2)
    time.sleep(0.3)
    fresh, kept = pool.take(a.peer_address, b.peer_secret, 5.0)
    assert not kept and fresh is not s1 and s1.sock.fileno() == -1  # the idle one was closed
    fresh.seq = 63
    pool.give_back(fresh, 2)  # would pass the owner's 64 requests: closed
    assert fresh.sock.fileno() == -1 and pool.kept[(a.peer_address, b.peer_secret)] == []
    pool.close()


def test_the_owners_view_of_a_puller_is_bounded(owner_and_puller, monkeypatch):
    """The owner keeps a puller's NIXL view (its connection and recent exposures) between writes, for at most
    PULLER_WRITES writes and PULLER_IDLE_S between them; then it is loaded afresh."""
    monkeypatch.setattr(nixl_transport, "PULLER_WRITES", 3)
    a, b = owner_and_puller()
    for i in range(5):
        assert b.pull_from_peer("acme", "alice", a.peer_address, [f"m{i % 3}"]).blocks == 1
        (writes, _), = a.transport.lanes[0].pullers.values()
        assert writes == [1, 2, 3, 1, 2][i]
    monkeypatch.setattr(nixl_transport, "PULLER_IDLE_S", 0.1)
    time.sleep(0.2)
    assert b.pull_from_peer("acme", "alice", a.peer_address, ["m0"]).blocks == 1
    (writes, _), = a.transport.lanes[0].pullers.values()
    assert writes == 1


def test_a_pull_with_the_index_sizes_is_one_round_trip(owner_and_puller):
    """The fleet path knows each block's size from the peer's index: slots exposed first, op ``pull`` leases and
    writes them in one request (locate + write took two)."""
    from inferscale.store.pulling import peer_index

    a, b = owner_and_puller()
    idx = peer_index(b, "acme", "alice", a.peer_address, FP)  # request 1
    assert sorted(idx.sizes) == ["m0", "m1", "m2"] and all(n > 0 for n in idx.sizes.values())
    pulled = b.pull_from_peer("acme", "alice", a.peer_address, ["m2", "m0"], FP,
                              sizes=[idx.sizes["m2"], idx.sizes["m0"]])
    assert pulled.blocks == 2
    (s,) = _kept(b, a.peer_address)
    assert s.seq == 2  # index, then one pull
    got, _ = b.get_many("acme", "alice", ["m2", "m0"], FP)
    assert [g.item_id for g in got] == ["m2", "m0"]
    assert all(torch.equal(g.kv, make_block(g.item_id).kv) for g in got)
    assert not a.peer_service.leases.leases  # the pull's lease ended with its write


def test_sizes_that_changed_since_the_index_fall_back_to_a_lease(owner_and_puller):
    """A block re-encoded after the index is another size: the owner writes nothing and says so (MACed), and the
    puller leases it afresh (locate + write) in the same session."""
    from inferscale.store.pulling import peer_index

    a, b = owner_and_puller()
    idx = peer_index(b, "acme", "alice", a.peer_address, FP)
    a.put("acme", "alice", make_block("m1", tokens=12))  # a new version of m1, of another size
    assert b.pull_from_peer("acme", "alice", a.peer_address, ["m1"], FP, sizes=[idx.sizes["m1"]]).blocks == 1
    (s,) = _kept(b, a.peer_address)
    assert s.seq == 4  # index, pull (changed: nothing written), locate, write
    got, _ = b.get_many("acme", "alice", ["m1"], FP)
    assert torch.equal(got[0].kv, make_block("m1", tokens=12).kv)


def test_a_large_write_goes_in_parallel_lanes_and_lands_exactly(owner_and_puller, monkeypatch):
    """The owner cuts a write into one part per lane (each its own NIXL agent, posted side by side); every byte
    lands where its block's slot is, checksums verified by the pull."""
    monkeypatch.setattr(nixl_transport, "LANE_MIN_BYTES", 1)
    a, b = owner_and_puller()
    assert len(a.transport.lanes) == nixl_transport.WRITE_LANES
    lanes = []
    write_to = a.transport.write_to
    monkeypatch.setattr(a.transport, "write_to", lambda *args, **kw: lanes.append(write_to(*args, **kw)) or lanes[-1])
    assert b.pull_from_peer("acme", "alice", a.peer_address, ["m0", "m1", "m2"]).blocks == 3
    assert lanes == [min(3, nixl_transport.WRITE_LANES)]
    got, _ = b.get_many("acme", "alice", ["m0", "m1", "m2"], FP)
    assert all(torch.equal(g.kv, make_block(g.item_id).kv) for g in got)


def test_split_ranges_cuts_equal_parts_in_order():
    from inferscale.store.nixl_transport import split_ranges

    pairs = [((0, 10), (1000, 10)), ((64, 3), (2000, 3)), ((128, 7), (3000, 7))]
    for parts in (1, 2, 3, 4):
        runs = split_ranges(pairs, parts)
        sizes = [sum(n for _, _, n in r) for r in runs]
        assert sum(sizes) == 20 and max(sizes) - min(sizes) <= parts  # equal within the rounding of 20 / parts
        flat = [x for r in runs for x in r]
        pos = {}  # every source byte goes to its own destination byte, once, in order
        for off, addr, n in flat:
            for k in range(n):
                assert (off + k) not in pos
                pos[off + k] = addr + k
        assert pos == {o + k: d + k for (o, n), (d, _) in pairs for k in range(n)}
    assert split_ranges(pairs, 2)[0] == [(0, 1000, 10)]
