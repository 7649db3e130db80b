import pytest

from inferscale.bench.node import child_process, serve_node
from inferscale.store import KVStore

from .helpers import FP, ITEMS, PEER_SECRET, PEER_TLS, make_block


@pytest.fixture
def open_store(tmp_path):
    """Factory for stores rooted in tmp_path; closes them all at the end."""
    stores = []

    def _open(root=None, **kw):
        kw.setdefault("dram_budget_bytes", 8 << 20)
        kw.setdefault("timeout_s", 5.0)
        kw.setdefault("peer_secret", PEER_SECRET)
        kw.setdefault("peer_tls", PEER_TLS)
        s = KVStore(root or tmp_path / "kv", **kw)
        stores.append(s)
        return s

    yield _open
    for s in stores:
        try:
            s.close()
        except Exception:
            pass


@pytest.fixture
def peer_node(tmp_path):
    """A child process serving peers on loopback from its own store: tenant acme's alice with ITEMS' six blocks
    (DRAM-resident) and tenant other's bob with one."""
    root = tmp_path / "peer"
    with KVStore(root, dram_budget_bytes=8 << 20, nixl=False) as s:
        for it in ITEMS:
            s.put("acme", "alice", make_block(it, tokens=5))
        s.put("other", "bob", make_block("x"))
    options = {"dram_budget_bytes": 8 << 20, "timeout_s": 10.0, "peer_secret": PEER_SECRET, "peer_tls": PEER_TLS,
               "preload": [("acme", "alice", FP)]}
    with child_process(serve_node, str(root), options) as info:
        yield info["peer"]
