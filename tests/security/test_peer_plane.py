"""Attacks on the authenticated peer plane with real stores and NIXL agents on loopback: a fake peer that relays
a real peer's nonce, an impostor that answers "not found", a peer that opens leases without end, and a node set
up without (or with a borrowed) peer secret."""

from __future__ import annotations

import socket
import time

import pytest

from inferscale.errors import ConfigError, QuotaExceededError, TransferError
from inferscale.store.fleet import Fleet
from inferscale.store import KVStore
from inferscale.store import peer as peerproto
from inferscale.store import peer_protocol as wire
from inferscale.store.leases import LeaseBook, LeaseCaps
from inferscale.store.tiers import DramEntry
from inferscale.bench.node import child_process, serve_node

from security.relay import Listener, Relay
from store.helpers import FP, PEER_SECRET, make_block  # tests/store/helpers.py (tests/ is on sys.path)


@pytest.fixture(scope="module")
def owner(tmp_path_factory):
    """Another pod (child process, real NIXL UCX agent) holding acme/alice, whose pin is in her memory."""
    root = tmp_path_factory.mktemp("owner")
    with KVStore(root, dram_budget_bytes=8 << 20, nixl=False) as s:
        s.put("acme", "alice", make_block("pin"))
    options = {"dram_budget_bytes": 8 << 20, "timeout_s": 10.0, "peer_secret": PEER_SECRET,
               "preload": [("acme", "alice", FP)]}
    with child_process(serve_node, str(root), options) as info:
        yield info["peer"]


def test_a_relaying_fake_peer_gets_no_lease(owner, tmp_path):
    """Before: the puller MACed whatever nonce the fake peer forwarded, so the real peer answered the relayed
    request with a lease (agent metadata + addresses) that the fake peer could READ: alice's pin."""
    relay = Relay(peerproto.parse_peer(owner))
    puller = KVStore(tmp_path / "puller", dram_budget_bytes=8 << 20, peer_secret=PEER_SECRET, timeout_s=5)
    try:
        with pytest.raises(TransferError):
            puller.pull_from_peer("acme", "alice", relay.address, fingerprint=FP)
        frames = relay.frames_received()
        assert frames, "the relay saw nothing from the real peer"
        assert not [f for f in frames if "lease" in f or "agent" in f], frames
        assert frames[-1].get("error") == "unauthorized"
        assert puller.pull_from_peer("acme", "alice", owner, fingerprint=FP).blocks == 1  # direct: served
    finally:
        relay.close()
        puller.close()


def _impostor(conn: socket.socket) -> None:
    """Listens on a peer's address without the secret and speaks the protocol: greets, then answers not_found."""
    with conn:
        try:
            wire.send_msg(conn, {"v": 2, "nonce": "00" * 16})
            wire.recv_msg(conn, wire.MAX_HELLO)
            wire.recv_msg(conn)
            wire.send_msg(conn, {"error": "not_found", "message": "no such user", "seq": 1, "auth": "0" * 64})
        except (OSError, ValueError):
            pass


def test_an_impostors_not_found_is_no_definite_miss(tmp_path):
    """Before: error replies carried no MAC, so an impostor's "not_found" made a fleet lookup a definite miss
    (chat answered without the user's memories). Now it is a TransferError (424): never an answer without them."""
    impostor = Listener(_impostor)
    store = KVStore(tmp_path / "local", dram_budget_bytes=8 << 20, peer_secret=PEER_SECRET, timeout_s=5)
    try:
        fleet = Fleet(store)
        fleet.set_peers([impostor.address])
        with pytest.raises(TransferError, match="could not be asked"):
            fleet.embeddings("acme", "alice", FP)
        with pytest.raises(TransferError, match="not authenticated"):
            store.pull_from_peer("acme", "alice", impostor.address, fingerprint=FP)
    finally:
        impostor.close()
        store.close()


def test_no_exposure_goes_to_a_peer_that_has_not_proved_the_secret(tmp_path):
    """A one-request ``pull`` carries the puller's NIXL metadata (its worker, which UCX's TCP and CMA transports do
    not bound by registration). In a fresh session the owner has not yet proved the secret (its first MACed reply
    does that), so the puller asks ``locate`` first there; only a session with a verified reply carries a pull."""
    seen: list[dict] = []

    def impostor(conn: socket.socket) -> None:
        with conn:
            try:
                wire.send_msg(conn, {"v": 2, "nonce": "00" * 16})
                wire.recv_msg(conn, wire.MAX_HELLO)
                seen.append(wire.recv_msg(conn))
                wire.send_msg(conn, {"ok": True, "bytes": 1, "sha256": ["0" * 64], "seq": 1, "auth": "0" * 64})
            except (OSError, ValueError):
                pass

    fake = Listener(impostor)
    store = KVStore(tmp_path / "local", dram_budget_bytes=8 << 20, peer_secret=PEER_SECRET, timeout_s=5)
    try:
        with pytest.raises(TransferError, match="not authenticated"):
            store.pull_from_peer("acme", "alice", fake.address, ["pin"], FP, sizes=[4096])
        assert [m.get("op") for m in seen] == ["locate"] and "agent" not in seen[0]
    finally:
        fake.close()
        store.close()


def test_leases_are_capped_per_peer_and_per_tenant_and_end_with_the_session(tmp_path):
    """Before: a peer could open leases without end, each a staging copy of the blocks kept 30 s."""
    owner = KVStore(tmp_path / "owner", dram_budget_bytes=8 << 20, peer_port=0, peer_host="127.0.0.1",
                    node="127.0.0.1", peer_secret=PEER_SECRET)
    try:
        owner.put("acme", "alice", make_block("m0"))
        owner.put("acme", "bob", make_block("m0"))
        owner.peer_service.leases.caps = LeaseCaps(per_peer=2, per_tenant=3, peer_bytes=8 << 20,
                                                   tenant_bytes=8 << 20)
        locate = {"op": "locate", "tenant": "acme", "user": "alice", "items": None, "fingerprint": FP, "dir": None}
        greedy = peerproto.PeerSession(owner.peer_address, PEER_SECRET, 5)
        for _ in range(2):
            assert "lease" in greedy.call(locate)
        refused = greedy.call(locate)
        assert refused["error"] == QuotaExceededError.__name__ and "holds 2 leases" in refused["message"]
        greedy.close()
        deadline = time.monotonic() + 3
        while owner.peer_service.leases.leases and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not owner.peer_service.leases.leases  # a session's leases end with it
        e = owner.dram.acquire(("acme", "alice", FP, "m0"))
        assert e.refs == 1  # only ours: no lease still holds the block
        owner.dram.release(e)
        byte_caps = LeaseCaps(per_peer=8, per_tenant=8, peer_bytes=1, tenant_bytes=8 << 20)
        owner.peer_service.leases.caps = byte_caps
        with peerproto.PeerSession(owner.peer_address, PEER_SECRET, 5) as s:
            assert "leased bytes" in s.call(locate)["message"]
    finally:
        owner.close()


def test_the_peer_secret_is_required_and_is_not_the_internal_token(tmp_path):
    from inferscale.server.settings import Settings

    with pytest.raises(ConfigError, match="peer secret"):
        KVStore(tmp_path / "a", dram_budget_bytes=8 << 20, peer_port=0, peer_host="127.0.0.1")
    with pytest.raises(ConfigError, match="at least"):
        KVStore(tmp_path / "b", dram_budget_bytes=8 << 20, peer_port=0, peer_host="127.0.0.1", peer_secret="short")
    with KVStore(tmp_path / "c", dram_budget_bytes=8 << 20) as puller, pytest.raises(ConfigError, match="SECRET"):
        puller.pull_from_peer("acme", "alice", "127.0.0.1:1", fingerprint=FP)
    same = "one-credential-for-both-planes"
    env = {"INFERSCALE_INTERNAL_TOKEN": same, "INFERSCALE_PEER_SECRET": same}
    with pytest.raises(ConfigError, match="INFERSCALE_PEER_SECRET.*INFERSCALE_INTERNAL_TOKEN"):
        Settings.from_env(env)
    assert Settings.from_env({**env, "INFERSCALE_PEER_SECRET": same + "-peer"}).peer_secret == same + "-peer"


def test_per_tenant_caps_count_every_peers_leases():
    released = []
    book = LeaseBook(LeaseCaps(per_peer=2, per_tenant=3, peer_bytes=1 << 20, tenant_bytes=1 << 20), released.append)
    block = DramEntry(("acme", "alice", FP, "m0"), 0, 1000, None)  # type: ignore[arg-type]
    book.open("s1", "10.0.0.1", "acme", [block])
    book.open("s1", "10.0.0.1", "acme", [block])
    with pytest.raises(QuotaExceededError, match="holds 2 leases"):
        book.open("s1", "10.0.0.1", "acme", [block])
    book.open("s2", "10.0.0.2", "acme", [block])
    with pytest.raises(QuotaExceededError, match="tenant 'acme' has 3 leases out"):
        book.open("s3", "10.0.0.3", "acme", [block])
    book.open("s3", "10.0.0.3", "globex", [block])  # another tenant's pulls are not held up by acme's
    assert len(released) == 2  # each refused lease gave its references back
    book.end_session("s1")
    assert len(released) == 4 and {x.session for x in book.leases.values()} == {"s2", "s3"}
