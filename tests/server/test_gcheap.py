"""The startup heap stays out of the cyclic collector while the app serves (server/gcheap.py): a full collection
during serving does not walk the engine's model, and what the app leaves behind is collectable once it stops."""

from __future__ import annotations

import gc
import json

from starlette.testclient import TestClient

from conftest import KEYS, MODEL
from inferscale.server.auth import hash_key
from inferscale.server.gcheap import startup_heap_frozen


def test_a_serving_app_keeps_its_startup_heap_out_of_collections(tmp_path, tiny_engine, embedder):
    from inferscale.server.app import create_app
    from inferscale.server.settings import Settings
    from inferscale.store import KVStore

    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"acme": [hash_key(KEYS["acme"])]}))
    settings = Settings(data_dir=tmp_path, tenants_file=tenants, model=MODEL)
    store = KVStore(settings.store_dir, dram_budget_bytes=16 << 20, nixl=False)
    app = create_app(settings, engine=tiny_engine, embedder=embedder, store=store)
    model = tiny_engine.loaded.model
    others = gc.get_freeze_count() > 0  # another app of this test session serving (its heap stays frozen)
    assert gc.is_tracked(model)
    try:
        with TestClient(app) as client:
            assert gc.get_freeze_count() > 0
            # what a collection walks: the model loaded before the app started is not among it
            assert not any(o is model for o in gc.get_objects())
            made_now = {"while serving": []}
            assert any(o is made_now for o in gc.get_objects())  # later objects are collected as before
            assert client.get("/readyz").status_code == 200
    finally:
        store.close()
    assert (gc.get_freeze_count() > 0) == others
    if not others:
        assert any(o is model for o in gc.get_objects())


def test_the_heap_is_unfrozen_when_the_last_app_stops():
    others = gc.get_freeze_count() > 0  # another app of this test session serving
    with startup_heap_frozen():
        frozen = gc.get_freeze_count()
        with startup_heap_frozen():
            assert gc.get_freeze_count() >= frozen
        assert gc.get_freeze_count() >= frozen  # the first app still serves
    assert (gc.get_freeze_count() > 0) == others
