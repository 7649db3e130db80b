"""Pulls keep their peer session open for the next pull (inferscale/store/peer_pool.py), and the owner keeps a
puller's NIXL view between writes (inferscale/store/nixl_transport.py), both bounded; a pull that fails closes
its session, so the owner's lease ends with it."""

import time

import pytest

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
        (writes, _), = a.transport._pullers.values()
        assert writes == [1, 2, 3, 1, 2][i]
    monkeypatch.setattr(nixl_transport, "PULLER_IDLE_S", 0.1)
    time.sleep(0.2)
    assert b.pull_from_peer("acme", "alice", a.peer_address, ["m0"]).blocks == 1
    (writes, _), = a.transport._pullers.values()
    assert writes == 1
