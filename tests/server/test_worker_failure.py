"""When the engine worker dies anyway (a bug, an exhausted device), the pod says so and gets out of the way: queued
requests get 503 + Retry-After at once, a running stream an in-band error, liveness fails and `inferscale serve`
exits (status EXIT_ENGINE_FAILED) so that Kubernetes restarts it; and any graceful shutdown completes within
INFERSCALE_SHUTDOWN_GRACE_S even with a stream open. Each test runs `inferscale serve` (cli.run) in a thread."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import KEYS, MODEL
from e2e_common import free_port
from inferscale.server import cli
from inferscale.server.auth import hash_key


class Serving:
    """`inferscale serve` over the tiny engine in a thread: its app, its listeners, its exit status."""

    def __init__(self, tmp_path, monkeypatch, engine, embedder) -> None:
        import uvicorn

        from inferscale.server import app as app_mod
        from inferscale.store import KVStore

        (tmp_path / "tenants.json").write_text(json.dumps({t: [hash_key(KEYS[t])] for t in ("acme", "globex")}))
        real_create, real_server = app_mod.create_app, uvicorn.Server
        self.servers: list = []
        self.app = None

        def create(settings):
            self.app = real_create(settings, engine=engine, embedder=embedder,
                                   store=KVStore(settings.store_dir, dram_budget_bytes=16 << 20, nixl=False))
            return self.app

        monkeypatch.setattr(app_mod, "create_app", create)
        monkeypatch.setattr(uvicorn, "Server", lambda config: self.servers.append(real_server(config)) or self.servers[-1])
        monkeypatch.setenv("INFERSCALE_MAX_TOKENS", "64")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        args = p.parse_args(["--data-dir", str(tmp_path), "--port", str(port), "--model", MODEL])
        self.status: int | None = None
        self.exited = threading.Event()
        threading.Thread(target=self._run, args=(args,), daemon=True).start()
        deadline = time.time() + 60
        while not (self.servers and all(s.started for s in self.servers)):
            assert time.time() < deadline and not self.exited.is_set(), "serve did not start"
            time.sleep(0.05)

    def _run(self, args) -> None:
        try:
            self.status = cli.run(args)
        finally:
            self.exited.set()

    @property
    def worker(self):
        return self.app.state.worker

    def chat(self, tenant: str = "acme", **fields) -> httpx.Response:
        return httpx.post(self.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                          timeout=30, json={"model": MODEL, "max_tokens": 4, **fields,
                                            "messages": [{"role": "user", "content": "who went camping?"}]})

    def stop(self) -> None:
        for s in self.servers:
            s.should_exit = True
        self.exited.wait(30)


@pytest.fixture
def serving(tmp_path, monkeypatch, tiny_engine, embedder):
    s = Serving(tmp_path, monkeypatch, tiny_engine, embedder)
    yield s
    s.stop()


def _in_process_healthz(app) -> int:
    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/healthz")).status_code
    return asyncio.run(get())


def test_a_dead_worker_answers_503_at_once_and_serve_exits(serving):
    loop = serving.worker.loop
    real_step, release = loop.step, threading.Event()

    def step():  # once the stream has its first token, the next step is a bug that kills the worker
        if any(r.output for r in loop.rows):
            release.wait(30)
            raise RuntimeError("a bug in the serving loop (simulated)")
        real_step()

    loop.step = step
    stream_lines: list[str] = []
    with httpx.stream("POST", serving.url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {KEYS['acme']}"},
                      json={"model": MODEL, "stream": True, "max_tokens": 64, "ignore_eos": True,
                            "messages": [{"role": "user", "content": "tell me everything"}]}) as stream:
        assert stream.status_code == 200  # headers come with the first token
        with ThreadPoolExecutor(4) as pool:
            queued = [pool.submit(serving.chat, tenant) for tenant in ("acme", "globex", "globex", "acme")]
            deadline = time.time() + 20
            while serving.worker.queued < 4:
                assert time.time() < deadline, "the requests did not queue"
                time.sleep(0.01)
            t0 = time.monotonic()
            release.set()
            answers = [f.result() for f in queued]
            waited = time.monotonic() - t0
        stream_lines = [line for line in stream.iter_lines() if line]
    print(f"4 queued requests answered 503 in {waited:.2f} s after the worker died")
    assert waited < 2, waited
    for r in answers:
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
    errors = [json.loads(line[6:]) for line in stream_lines if line.startswith("data: {") and '"error"' in line]
    assert errors and errors[0]["error"]["code"] == "engine_unavailable"
    assert stream_lines[-1] == "data: [DONE]"
    assert _in_process_healthz(serving.app) == 503  # liveness fails
    assert serving.exited.wait(15), "serve did not exit after the engine worker failed"
    assert serving.status == cli.EXIT_ENGINE_FAILED


def test_graceful_shutdown_completes_within_its_grace_with_a_stream_open(tmp_path, monkeypatch, tiny_engine,
                                                                           embedder):
    monkeypatch.setenv("INFERSCALE_SHUTDOWN_GRACE_S", "1")
    serving = Serving(tmp_path, monkeypatch, tiny_engine, embedder)
    loop = serving.worker.loop
    real_forward = loop._last_rows

    def slow_forward(rows, starts, ids, *last):  # a long answer: about 13 s of decoding
        time.sleep(0.2)
        return real_forward(rows, starts, ids, *last)

    loop._last_rows = slow_forward
    with httpx.stream("POST", serving.url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {KEYS['acme']}"},
                      json={"model": MODEL, "stream": True, "max_tokens": 64, "ignore_eos": True,
                            "messages": [{"role": "user", "content": "tell me everything"}]}) as stream:
        assert stream.status_code == 200
        idle = httpx.Client(base_url=serving.url)  # and an idle keep-alive connection
        assert idle.get("/healthz").status_code == 200
        t0 = time.monotonic()
        serving.servers[0].should_exit = True  # what SIGTERM does
        assert serving.exited.wait(10), "graceful shutdown did not complete"
        took = time.monotonic() - t0
        idle.close()
    print(f"graceful shutdown with a stream open took {took:.2f} s (grace 1 s)")
    assert took < 1 + 5, took  # the grace, then the engine's close
    assert serving.status == 0
