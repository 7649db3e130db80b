"""The server runs each first-request path once before it listens (server/warmup.py), touching no tenant's data."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from inferscale.errors import NotFoundError
from inferscale.server.warmup import WARMUP_TENANT, warm_up
from inferscale.contract import is_valid_tenant


def test_the_engine_has_served_both_paths_before_the_first_request(acme_app):
    worker = acme_app.state.worker
    assert worker.rounds == 0 and worker.prompt_token_s is None  # nothing ran while the app was built
    with TestClient(acme_app) as client:
        assert worker.rounds >= 2  # a kv and a text request, two tokens each
        assert worker.prompt_token_s is not None  # the cost model measured a pass: admission predicts from it
        assert worker.active == 0 and worker.queued == 0
        with pytest.raises(NotFoundError):  # its memory was encoded, never stored
            acme_app.state.store.users("acme")
        assert client.get("/readyz").json() == {"status": "ready"}


def test_a_burst_of_one_request_a_slot_prices_a_full_batchs_pass_before_the_first_tenant(acme_app):
    """The cost model knows what a pass of the lone tenant's part of the slots costs before any tenant's burst:
    admission prices a full batch's waits for room by it (``StepCost.decode_seconds``)."""
    worker = acme_app.state.worker
    scheduler = worker.loop.scheduler
    part = scheduler.config.max_running - scheduler.capacity.slot_reserve
    with TestClient(acme_app):
        rows = max(r for r, kind in worker.step_totals if kind == "decode")
        assert rows == part  # every row of the warm-up tenant's part decoded together
        assert scheduler.cost.decode_row_s is not None  # a row's cost measured: the full batch is priced by it
        assert worker.active == 0 and worker.queued == 0 and scheduler.capacity.held == 0


def test_its_tenant_is_no_tenant_name():
    assert not is_valid_tenant(WARMUP_TENANT)


def test_a_failing_warm_up_is_logged_and_the_server_starts_all_the_same(acme_app, caplog, monkeypatch):
    def broken(_req):
        raise RuntimeError("no engine today")

    monkeypatch.setattr(acme_app.state.worker, "submit", broken)
    with caplog.at_level(logging.WARNING, logger="inferscale.server.warmup"), TestClient(acme_app) as client:
        assert client.get("/readyz").status_code == 200
    assert any("warm-up failed (RuntimeError: no engine today)" in r.getMessage() for r in caplog.records)


def test_an_error_event_fails_the_warm_up(acme_app, caplog):
    """A request the engine answers with an error is a failed warm-up (logged), not one that waits forever."""
    from inferscale.engine.loop import ErrorEvent

    worker = acme_app.state.worker

    class Refusing:
        engine, modes, call, prompt_ids = worker.engine, worker.modes, worker.call, worker.prompt_ids

        @staticmethod
        def submit(req):
            req.emit(ErrorEvent(RuntimeError("refused")))

    with TestClient(acme_app) as client, caplog.at_level(logging.WARNING, logger="inferscale.server.warmup"):
        client.portal.call(warm_up, Refusing(), acme_app.state.embedder.embed_query)  # on the app's loop
    assert any("warm-up failed (RuntimeError: refused)" in r.getMessage() for r in caplog.records)
