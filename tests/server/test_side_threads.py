"""Only the engine thread runs torch on every core (inferscale/engine/threads.py): the server's event loop and the
threads it hands work to (retrieval's embedding, fetches) run torch on one core and so keep no OpenMP pool, whose
idle workers would stop every pool's workers from spinning between kernels (a server token 34 ms against 20)."""

from __future__ import annotations

import asyncio
import threading

import torch
from starlette.testclient import TestClient


def test_the_event_loop_and_its_worker_threads_run_torch_on_one_core(acme_app):
    default = torch.get_num_threads()

    async def loop_thread() -> int:
        return torch.get_num_threads()

    with TestClient(acme_app) as client:
        assert client.portal.call(loop_thread) == 1
        assert client.portal.call(asyncio.to_thread, torch.get_num_threads) == 1
    assert torch.get_num_threads() == default  # this thread, and torch's default, as they were


def test_retrieval_embeds_on_the_engine_thread_when_it_is_idle_else_beside_it(acme_app):
    """An idle engine's thread computes the query's embedding on every core; with requests in flight it stays on a
    side thread (one core), as before."""
    service, seen = acme_app.state.memories, []

    def record() -> str:
        seen.append(threading.current_thread().name)
        return seen[-1]

    with TestClient(acme_app) as client:
        client.portal.call(service._on_idle_cores, record)
        assert seen[-1].startswith("inferscale-engine")
        worker = acme_app.state.worker
        busy = type(worker).active
        try:
            type(worker).active = property(lambda self: 1)
            client.portal.call(service._on_idle_cores, record)
        finally:
            type(worker).active = busy
        assert seen[-1].startswith("inferscale-io")
