"""Attacks on the peer data plane: a puller's own NIXL agent (raw nixl-cu12 API, no InferScale code on the
attacker's side) against a serving node in another process on loopback, with everything a lease gives it.

UCX's TCP and shared-memory transports do not check a remote READ against the registration it names: with a
serving node's metadata, a reader that patched the address and length in it read ~140 KiB (and more) of that
process outside its lease. So a lease carries no metadata of the owner at all: the owner WRITEs exactly the
leased blocks into the ranges the puller exposed, with its own library."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
import pytest

from inferscale.store import KVStore
from inferscale.store import peer as peerproto
from inferscale.bench.node import child_process, serve_node

from store.helpers import FP, PEER_SECRET, make_block  # tests/store/helpers.py (tests/ is on sys.path)

CANARY = 0xAB


@pytest.fixture(scope="module")
def owner(tmp_path_factory):
    """A serving node (child process, real NIXL UCX agent) holding acme/alice and globex/bob in DRAM."""
    root = tmp_path_factory.mktemp("owner")
    with KVStore(root, dram_budget_bytes=8 << 20, nixl=False) as s:
        for it in ("a0", "a1"):
            s.put("acme", "alice", make_block(it))
        s.put("globex", "bob", make_block("b0"))
    options = {"dram_budget_bytes": 8 << 20, "timeout_s": 10.0, "peer_secret": PEER_SECRET,
               "preload": [("acme", "alice", FP), ("globex", "bob", FP)]}
    with child_process(serve_node, str(root), options) as info:
        yield info["peer"]


class Attacker:
    """A bare NIXL agent exposing a buffer of its own (canaries around whatever ranges it names)."""

    def __init__(self, size: int) -> None:
        import nixl_cu12 as nixl

        self.agent = nixl.nixl_agent(f"attacker-{uuid.uuid4().hex[:6]}",
                                     nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX")
        self.buf = np.full(size, CANARY, dtype=np.uint8)
        self.reg = self.agent.register_memory([(self.buf.ctypes.data, size, 0, "")], "DRAM", backends=["UCX"])
        self.metadata = self.agent.get_partial_agent_metadata(self.reg, True, ["UCX"])

    def write_request(self, lease: str, dsts: list[tuple[int, int]]) -> dict:
        return {"op": "write", "lease": lease, "agent": base64.b64encode(self.metadata).decode(),
                "dsts": [[self.buf.ctypes.data + off, n] for off, n in dsts]}

    def progress(self) -> None:
        self.agent.get_new_notifs()


def _locate(tenant: str, user: str) -> dict:
    return {"op": "locate", "tenant": tenant, "user": user, "items": None, "fingerprint": FP, "dir": None}


def _blob_holds(data: bytes, item: str) -> bool:
    return make_block(item).kv.numpy().tobytes()[:4096] in data


def test_a_lease_names_no_memory_of_the_owner(owner):
    """Before: the lease reply held the owner's agent metadata and the staging addresses, which a reader could
    patch to read outside its lease. Now nothing in it can be loaded as a NIXL agent or names an address."""
    with peerproto.PeerSession(owner, PEER_SECRET, 10) as s:
        reply = s.call(_locate("acme", "alice"))
        assert set(reply) == {"lease", "node", "blocks"}
        assert all(set(b) == {"item", "fingerprint", "size", "sha256"} for b in reply["blocks"])
        assert s.call({"op": "release", "lease": reply["lease"]}) == {"ok": True}


def test_the_owner_writes_exactly_the_leased_blocks_and_nothing_else(owner):
    att = Attacker(4 << 20)
    with peerproto.PeerSession(owner, PEER_SECRET, 10) as s:
        reply = s.call(_locate("acme", "alice"))
        sizes = [b["size"] for b in reply["blocks"]]
        dsts = [(4096, sizes[0]), (4096 + sizes[0] + 8192, sizes[1])]  # gaps the owner must not touch
        done = s.call(att.write_request(reply["lease"], dsts), progress=att.progress)
        assert done == {"ok": True, "bytes": sum(sizes)}
    for (off, n), b in zip(dsts, reply["blocks"]):
        assert _blob_holds(att.buf[off : off + n].tobytes(), b["item"])
    outside = np.ones(att.buf.size, dtype=bool)
    for off, n in dsts:
        outside[off : off + n] = False
    assert (att.buf[outside] == CANARY).all(), "the owner wrote outside the ranges of the lease"
    assert not _blob_holds(att.buf.tobytes(), "b0")  # globex/bob's block went nowhere


def test_write_refuses_ranges_unlike_the_lease_and_ends_it(owner):
    att = Attacker(1 << 20)
    with peerproto.PeerSession(owner, PEER_SECRET, 10) as s:
        reply = s.call(_locate("acme", "alice"))
        sizes = [b["size"] for b in reply["blocks"]]
        bigger = s.call(att.write_request(reply["lease"], [(0, sizes[0] + 4096), (sizes[0] + 8192, sizes[1])]),
                        progress=att.progress)
        assert bigger["error"] == "bad_request"
        again = s.call(att.write_request(reply["lease"], [(0, sizes[0]), (sizes[0], sizes[1])]),
                       progress=att.progress)
        assert again["error"] == "bad_request" and "no such lease" in again["message"]
    assert (att.buf == CANARY).all()


def test_a_lease_belongs_to_its_session_alone(owner):
    att = Attacker(1 << 20)
    with peerproto.PeerSession(owner, PEER_SECRET, 10) as first:
        reply = first.call(_locate("globex", "bob"))
        with peerproto.PeerSession(owner, PEER_SECRET, 10) as second:
            n = reply["blocks"][0]["size"]
            stolen = second.call(att.write_request(reply["lease"], [(0, n)]), progress=att.progress)
            assert stolen["error"] == "bad_request"
        assert first.call({"op": "release", "lease": reply["lease"]}) == {"ok": True}
    time.sleep(0.05)
    assert (att.buf == CANARY).all()


def _pull_request(att: Attacker, tenant: str, user: str, items: list[str], sizes: list[int],
                  dsts: list[tuple[int, int]]) -> dict:
    return {"op": "pull", "tenant": tenant, "user": user, "items": items, "fingerprint": FP, "sizes": sizes,
            "agent": base64.b64encode(att.metadata).decode(),
            "dsts": [[att.buf.ctypes.data + off, n] for off, n in dsts]}


def test_a_one_request_pull_writes_only_blocks_of_the_sizes_it_named(owner):
    """Op ``pull`` (locate + write in one request): sizes unlike the owner's blocks are refused as ``changed``
    before anything is written; ranges unlike the sizes are refused; the exact request lands exactly."""
    att = Attacker(4 << 20)
    with peerproto.PeerSession(owner, PEER_SECRET, 10) as s:
        located = s.call(_locate("acme", "alice"))
        sizes = [b["size"] for b in located["blocks"]]
        assert s.call({"op": "release", "lease": located["lease"]}) == {"ok": True}
        items = [b["item"] for b in located["blocks"]]
        bigger = [n + 4096 for n in sizes]  # would let the owner write past each block into the gaps
        dsts = [(0, bigger[0]), (bigger[0] + 8192, bigger[1])]
        changed = s.call(_pull_request(att, "acme", "alice", items, bigger, dsts), progress=att.progress)
        assert changed["error"] == "changed"
        unlike = s.call(_pull_request(att, "acme", "alice", items, sizes, dsts), progress=att.progress)
        assert unlike["error"] == "bad_request"
        assert (att.buf == CANARY).all()
        exact = [(4096, sizes[0]), (4096 + sizes[0] + 8192, sizes[1])]
        done = s.call(_pull_request(att, "acme", "alice", items, sizes, exact), progress=att.progress)
        assert done["ok"] is True and done["sha256"] == [b["sha256"] for b in located["blocks"]]
    outside = np.ones(att.buf.size, dtype=bool)
    for (off, n), item in zip(exact, items):
        assert _blob_holds(att.buf[off : off + n].tobytes(), item)
        outside[off : off + n] = False
    assert (att.buf[outside] == CANARY).all(), "the owner wrote outside the ranges of the pull"
    assert not _blob_holds(att.buf.tobytes(), "b0")  # globex/bob's block went nowhere
