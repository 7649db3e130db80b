"""Attacks on the peer data plane: a puller's own NIXL agent (raw nixl-cu12 API, no InferScale code on the
attacker's side) reading a serving node in another process on loopback with what one lease reply gave it:
after the lease ended, outside the leased ranges, and the slot of a block that was freed since."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
import pytest

from inferscale.store import KVStore
from inferscale.store import peer as peerproto
from inferscale.bench.node import child_process, serve_node

from store.helpers import FP, make_block  # tests/store/helpers.py (tests/ is on sys.path)

SECRET = "peer-secret-for-lease-tests"


@pytest.fixture(scope="module")
def owner(tmp_path_factory):
    """A serving node (child process, real NIXL UCX agent) holding acme/alice and globex/bob in DRAM."""
    root = tmp_path_factory.mktemp("owner")
    with KVStore(root, dram_budget_bytes=8 << 20, nixl=False) as s:
        for it in ("a0", "a1"):
            s.put("acme", "alice", make_block(it))
        s.put("globex", "bob", make_block("b0"))
    options = {"dram_budget_bytes": 8 << 20, "timeout_s": 10.0, "peer_secret": SECRET,
               "preload": [("acme", "alice", FP), ("globex", "bob", FP)]}
    with child_process(serve_node, str(root), options) as info:
        yield info["peer"]


class Attacker:
    """A bare NIXL agent that keeps whatever metadata it was given and READs any (address, size) it likes."""

    def __init__(self) -> None:
        import nixl_cu12 as nixl

        self.agent = nixl.nixl_agent(f"attacker-{uuid.uuid4().hex[:6]}",
                                     nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX")
        self.remote: str | None = None

    def load(self, metadata: bytes) -> None:
        self.remote = self.agent.add_remote_agent(metadata)

    def read(self, addr: int, size: int) -> bytes | None:
        """The bytes at the peer's ``addr``, or None when NIXL refuses or the transfer fails."""
        dst = np.zeros(size, dtype=np.uint8)
        reg = self.agent.register_memory([(dst.ctypes.data, size, 0, "")], "DRAM", backends=["UCX"])
        try:
            local = self.agent.get_xfer_descs([(dst.ctypes.data, size, 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(addr, size, 0)], "DRAM")
            handle = self.agent.initialize_xfer("READ", local, remote, self.remote, backends=["UCX"])
            state, deadline = self.agent.transfer(handle), time.monotonic() + 5
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            return dst.tobytes() if state == "DONE" else None
        except Exception:  # noqa: BLE001 - nixl raises its own types: a refusal
            return None
        finally:
            self.agent.deregister_memory(reg, backends=["UCX"])


def _lease(peer: str, tenant: str, user: str) -> dict:
    reply = peerproto.request(peer, {"op": "locate", "tenant": tenant, "user": user, "items": None,
                                     "fingerprint": FP, "dir": None}, 10, SECRET)
    assert "error" not in reply, reply
    return reply


def _release(peer: str, lease: str) -> None:
    assert peerproto.request(peer, {"op": "release", "lease": lease}, 10, SECRET) == {"ok": True}


def _kv_bytes(item: str) -> bytes:
    return make_block(item).kv.numpy().tobytes()[:4096]  # the first 4 KiB of the block's tensor bytes


def _holds(data: bytes | None, item: str) -> bool:
    return data is not None and _kv_bytes(item) in data


def test_lease_reads_its_blocks_and_nothing_else(owner):
    reply = _lease(owner, "acme", "alice")
    att = Attacker()
    att.load(base64.b64decode(reply["agent"]))
    try:
        blocks = reply["blocks"]
        for b in blocks:  # what the lease grants: readable
            assert _holds(att.read(b["addr"], b["size"]), b["item"])
        first, last = min(b["addr"] for b in blocks), max(b["addr"] + b["size"] for b in blocks)
        assert att.read(first - 4096, 4096) is None  # just before the leased bytes
        assert att.read(last, 4096) is None  # just after
        assert att.read(first - (1 << 20), 1 << 20) is None  # where other tenants' blocks would sit
    finally:
        _release(owner, reply["lease"])


def test_no_read_after_the_lease_ends(owner):
    reply = _lease(owner, "acme", "alice")
    att = Attacker()
    att.load(base64.b64decode(reply["agent"]))
    b = reply["blocks"][0]
    assert _holds(att.read(b["addr"], b["size"]), b["item"])
    _release(owner, reply["lease"])
    got = att.read(b["addr"], b["size"])  # the same descriptors, the same loaded metadata
    assert got is None or not any(got), "a released lease still exposes bytes"


def test_a_freed_slot_never_exposes_another_tenants_block(owner):
    """Lease acme/alice, end it, lease globex/bob: alice's old descriptors read zeros (or fail), never bob."""
    first = _lease(owner, "acme", "alice")
    att = Attacker()
    att.load(base64.b64decode(first["agent"]))
    _release(owner, first["lease"])
    second = _lease(owner, "globex", "bob")
    try:
        for b in first["blocks"]:
            got = att.read(b["addr"], b["size"])
            assert got is None or not any(got), "a freed slot still holds bytes"
            assert not _holds(got, "b0")
    finally:
        _release(owner, second["lease"])
