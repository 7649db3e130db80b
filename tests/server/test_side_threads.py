"""Only the engine thread runs torch on every core (inferscale/engine/threads.py): the server's event loop and the
threads it hands work to (retrieval's embedding, fetches) run torch on one core and so keep no OpenMP pool, whose
idle workers would stop every pool's workers from spinning between kernels (a server token 34 ms against 20)."""

from __future__ import annotations

import asyncio
import json

import torch
from starlette.testclient import TestClient

from conftest import KEYS, MODEL
from inferscale.server.auth import hash_key


def test_the_event_loop_and_its_worker_threads_run_torch_on_one_core(tmp_path, tiny_engine, embedder):
    from inferscale.server.app import create_app
    from inferscale.server.settings import Settings
    from inferscale.store import KVStore

    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"acme": [hash_key(KEYS["acme"])]}))
    settings = Settings(data_dir=tmp_path, tenants_file=tenants, model=MODEL)
    store = KVStore(settings.store_dir, dram_budget_bytes=16 << 20, nixl=False)
    app = create_app(settings, engine=tiny_engine, embedder=embedder, store=store)
    default = torch.get_num_threads()

    async def loop_thread() -> int:
        return torch.get_num_threads()

    try:
        with TestClient(app) as client:
            assert client.portal.call(loop_thread) == 1
            assert client.portal.call(asyncio.to_thread, torch.get_num_threads) == 1
    finally:
        store.close()
    assert torch.get_num_threads() == default  # this thread, and torch's default, as they were
