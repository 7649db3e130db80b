import pytest

from inferscale.store import KVStore

from .helpers import PEER_SECRET, PEER_TLS


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
