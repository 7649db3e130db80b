"""The attack matrix of the trust boundary (ARCHITECTURE.md, "Trust boundary"). Server-plane attacks run against
the same live server as tests/server (tenant listener + internal listener on loopback); peer-plane attacks use
real NIXL agents in a second process; sealing attacks use stores opened the way the server opens them
(``server.app.open_store``: the KEK setting, NIXL on) and blocks whose tensors and metadata an attacker would want
to forge."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from inferscale.kvformat import KVBlock

_spec = importlib.util.spec_from_file_location("server_live_fixtures",
                                               Path(__file__).resolve().parents[1] / "server" / "conftest.py")
_server = importlib.util.module_from_spec(_spec)
sys.modules["server_live_fixtures"] = _server
_spec.loader.exec_module(_server)

# The live server and what it is built from (session-scoped; see tests/server/conftest.py).
live, tiny_engine, embedder = _server.live, _server.tiny_engine, _server.embedder

FP = "f" * 64
LAYERS, HEADS, DIM = 2, 1, 2048  # 4 tokens: 128 KiB of kv, above the store's block floor


def make_block(item: str, *, text: str | None = None, seed: int = 0, start_pos: int = 7) -> KVBlock:
    g = torch.Generator().manual_seed(seed)
    return KVBlock(item_id=item, text=text or f"secret memory {item}", token_ids=[11, 12, 13, 14],
                   start_pos=start_pos, kv=torch.randn(LAYERS, 2, HEADS, 4, DIM, generator=g),
                   model_fingerprint=FP, prefix_sha256="p" * 64, embedding=torch.randn(16, generator=g))


@pytest.fixture
def server_store(tmp_path):
    """Factory: the store a server with data dir ``tmp_path/data`` (and optional KEK file) opens."""
    from inferscale.server.app import open_store
    from inferscale.server.settings import Settings

    opened = []

    def _open(**kw):
        kw.setdefault("data_dir", tmp_path / "data")
        kw.setdefault("dram_budget_bytes", 16 << 20)
        s = open_store(Settings(**kw))
        opened.append(s)
        return s

    yield _open
    for s in opened:
        try:
            s.close()
        except Exception:
            pass
