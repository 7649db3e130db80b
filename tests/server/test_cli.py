"""`inferscale serve` (settings, tenants file creation, key printed once) and `inferscale demo` against a live server."""

from __future__ import annotations

import argparse
import json

from inferscale.server import cli, demo
from inferscale.server.auth import TenantRegistry, hash_key

from conftest import KEYS


def _args(mod, argv):
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    return p.parse_args(argv)


def test_serve_creates_tenant_and_prints_key(tmp_path, monkeypatch, capsys, tiny_engine, embedder):
    from inferscale.server import app as app_mod

    seen = {}
    real_create = app_mod.create_app

    def fake_create(settings):
        seen["settings"] = settings
        store_settings = settings.model_copy(update={"internal_token": None})
        from inferscale.store import KVStore

        return real_create(store_settings, engine=tiny_engine, embedder=embedder,
                           store=KVStore(settings.store_dir, dram_budget_bytes=16 << 20, nixl=False))

    monkeypatch.setattr(app_mod, "create_app", fake_create)
    async def serve(servers, engine_alive=None):  # stands in for the listeners: records what they were given
        seen.update(port=servers[0].config.port, configs=[s.config for s in servers], engine_alive=engine_alive)
        return 0

    monkeypatch.setattr(cli, "serve_together", serve)
    monkeypatch.setenv("INFERSCALE_PORT", "9001")
    args = _args(cli, ["--data-dir", str(tmp_path), "--port", "9002", "--tenant", "team-a", "--default-k", "7"])
    assert cli.run(args) == 0
    out = capsys.readouterr().out
    key = next(w for w in out.split() if w.startswith("isk-"))
    stored = json.loads((tmp_path / "tenants.json").read_text())
    assert stored == {"team-a": [hash_key(key)]} and key not in (tmp_path / "tenants.json").read_text()
    assert seen["port"] == 9002 and seen["settings"].default_k == 7  # flags win over the environment
    # uvicorn's access log (raw paths) is off; shutdown waits at most the grace; an engine failure ends serving.
    assert [(c.access_log, c.timeout_graceful_shutdown) for c in seen["configs"]] == [(False, 20.0)]
    assert seen["engine_alive"] is not None and seen["engine_alive"]()
    reg = TenantRegistry(tmp_path / "tenants.json", max_k=1, max_tokens=1, max_in_flight=1)
    assert reg.authenticate(key).name == "team-a"
    # A second start keeps the file and prints no key.
    assert cli.run(args) == 0
    assert "isk-" not in capsys.readouterr().out


def test_demo_against_live_server(live, capsys):
    args = _args(demo, ["--url", live.url, "--api-key", KEYS["globex"], "-k", "5", "--repeats", "1", "--user", "demo-user"])
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    assert "Loaded 32 memories" in out
    assert "kv    TTFT" in out and "text  TTFT" in out


def test_serve_runs_the_tenant_and_internal_listeners_together(tmp_path, monkeypatch, tiny_engine, embedder):
    """With an internal token, `inferscale serve` answers /v1 on INFERSCALE_PORT and /internal/v1 only on
    INFERSCALE_INTERNAL_PORT, in one process; stopping one listener stops both."""
    import asyncio
    import threading
    import time

    import httpx
    import uvicorn

    from e2e_common import free_ports
    from inferscale.server import app as app_mod
    from inferscale.store import KVStore

    real_create, servers = app_mod.create_app, []
    monkeypatch.setattr(app_mod, "create_app", lambda settings: real_create(
        settings, engine=tiny_engine, embedder=embedder,
        store=KVStore(settings.store_dir, dram_budget_bytes=16 << 20, nixl=False)))
    real_server = uvicorn.Server
    monkeypatch.setattr(uvicorn, "Server", lambda config: servers.append(real_server(config)) or servers[-1])
    port, internal = free_ports(2)
    monkeypatch.setenv("INFERSCALE_INTERNAL_TOKEN", "tok-internal")
    args = _args(cli, ["--data-dir", str(tmp_path), "--port", str(port), "--internal-port", str(internal)])
    done = threading.Event()
    threading.Thread(target=lambda: (cli.run(args), done.set()), daemon=True).start()
    deadline = time.time() + 60
    while not (len(servers) == 2 and all(s.started for s in servers)):
        assert time.time() < deadline and not done.is_set(), "listeners did not start"
        time.sleep(0.05)
    # uvicorn[standard]'s stack, as the server extra installs it: httptools parses, uvloop runs the loop
    assert [s.config.http_protocol_class.__name__ for s in servers] == ["HttpToolsProtocol"] * 2
    auth = {"Authorization": "Bearer tok-internal"}
    assert httpx.get(f"http://127.0.0.1:{internal}/internal/v1/capacity", headers=auth).status_code == 200
    assert httpx.get(f"http://127.0.0.1:{port}/internal/v1/capacity", headers=auth).status_code == 404
    assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    servers[1].should_exit = True  # the internal listener stops: the tenant one follows
    assert done.wait(15)
    assert asyncio.iscoroutinefunction(cli.serve_together)


def test_serve_runs_its_event_loop_on_uvloop():
    """Every streamed token is a socket write and callbacks on the serving loop, on the engine's cores: the server
    extra brings uvloop and ``inferscale serve`` runs on it (asyncio's loop only where it is not installed)."""
    import asyncio

    import uvloop

    factory = cli.event_loop_factory()
    assert factory is uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(_loop_type()) is uvloop.Loop


async def _loop_type() -> type:
    import asyncio

    return type(asyncio.get_running_loop())
