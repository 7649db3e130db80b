"""The startup heap stays out of the cyclic collector while the app serves (server/gcheap.py): a full collection
during serving does not walk the engine's model, and what the app leaves behind is collectable once it stops."""

from __future__ import annotations

import gc

from starlette.testclient import TestClient

from inferscale.server.gcheap import startup_heap_frozen


def test_a_serving_app_keeps_its_startup_heap_out_of_collections(acme_app, tiny_engine):
    model = tiny_engine.loaded.model
    others = gc.get_freeze_count() > 0  # another app of this test session serving (its heap stays frozen)
    assert gc.is_tracked(model)
    with TestClient(acme_app) as client:
        assert gc.get_freeze_count() > 0
        # what a collection walks: the model loaded before the app started is not among it
        assert not any(o is model for o in gc.get_objects())
        made_now = {"while serving": []}
        assert any(o is made_now for o in gc.get_objects())  # later objects are collected as before
        assert client.get("/readyz").status_code == 200
    assert (gc.get_freeze_count() > 0) == others
    if not others:
        assert any(o is model for o in gc.get_objects())


def test_the_heap_is_unfrozen_when_the_last_app_stops():
    others = gc.get_freeze_count() > 0  # another app of this test session serving
    startup = {"made before the first app": []}

    def collected() -> bool:  # among what a collection walks
        return any(o is startup for o in gc.get_objects())

    with startup_heap_frozen():
        assert not collected()
        with startup_heap_frozen():
            assert not collected()
        assert not collected()  # the first app still serves
    assert collected() != others
