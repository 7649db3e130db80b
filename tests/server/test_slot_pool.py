"""The server reserves its decode slots' K/V before it listens (INFERSCALE_KV_SLOTS x INFERSCALE_KV_SLOT_TOKENS), within
the K/V budget of its running requests (INFERSCALE_KV_CACHE_BYTES)."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from conftest import KEYS, MODEL
from inferscale.server.auth import hash_key


def test_the_server_starts_with_the_slot_pool_its_settings_reserve(tmp_path, tiny_engine, embedder):
    """Issue 22: a first flood of long prompts grew the pool twice, each growth a ~250 ms stall of every tenant's
    step; the settings' pool is there before the first request (and read from the environment, as the chart sets
    it)."""
    from inferscale.server.app import create_app
    from inferscale.server.settings import Settings
    from inferscale.store import KVStore

    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"acme": [hash_key(KEYS["acme"])]}))
    budget = 5000 * tiny_engine.kv_token_bytes + 1
    settings = Settings.from_env({"INFERSCALE_KV_SLOTS": "7", "INFERSCALE_KV_SLOT_TOKENS": "300",
                                  "INFERSCALE_KV_CACHE_BYTES": str(budget)},
                                 data_dir=tmp_path, tenants_file=tenants, model=MODEL)
    store = KVStore(settings.store_dir, dram_budget_bytes=16 << 20, nixl=False)
    try:
        app = create_app(settings, engine=tiny_engine, embedder=embedder, store=store)
        with TestClient(app):
            pool = app.state.worker.loop.slots
            assert pool.reserved == (7, 300)  # backed before it listens; on a CPU, mapped to the whole context
            assert pool.grown_s == 0.0  # the warm-up's requests fit it too
            kv = app.state.worker.loop.scheduler.capacity
            assert kv.tokens == 5000  # INFERSCALE_KV_CACHE_BYTES, in tokens
            # held back for a tenant arriving: the largest request there can be, at most half the budget
            assert kv.token_reserve == min(2500, tiny_engine.loaded.layout.max_positions)
    finally:
        store.close()
