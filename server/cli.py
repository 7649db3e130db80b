"""``inferscale serve``: engine, store, retrieval and the OpenAI-compatible API in one process (single node).

Settings come from ``INFERSCALE_*`` (docs/interfaces.md) and these flags, which win. With no tenants file, one is
created holding a single tenant, and that tenant's fresh API key is printed once (only its hash is stored).

If the engine fails (its worker thread died: a bug, an exhausted device), the listeners shut down gracefully and
``serve`` exits with ``EXIT_ENGINE_FAILED``, so Kubernetes restarts the container; every shutdown waits at most
INFERSCALE_SHUTDOWN_GRACE_S for open requests and streams, then cancels them."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable

from inferscale.contract import ENGINES, KV_DTYPES, MODES
from inferscale.errors import ConfigError
from inferscale.fleettls import FleetTls

log = logging.getLogger(__name__)
EXIT_ENGINE_FAILED = 3  # the process exit status when the engine worker failed (the container is restarted)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="bind address (INFERSCALE_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="tenant API port (INFERSCALE_PORT, default 8000)")
    p.add_argument("--internal-port", type=int,
                   help="internal API port, served only with INFERSCALE_INTERNAL_TOKEN (INFERSCALE_INTERNAL_PORT, 8001)")
    p.add_argument("--model", help="model name or path (INFERSCALE_MODEL, default gemma-3-270m)")
    p.add_argument("--engine", choices=ENGINES,
                   help="what serves questions (INFERSCALE_ENGINE, default pytorch): the project's PyTorch loop, or "
                        "TensorRT-LLM in-process with the InferScale KV connector (needs tensorrt_llm)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="INFERSCALE_DEVICE (default: cuda when available)")
    p.add_argument("--data-dir", help="store and tenants file live here (INFERSCALE_DATA_DIR)")
    p.add_argument("--tenants-file", help="hashed API keys, JSON (INFERSCALE_TENANTS_FILE; default DATA_DIR/tenants.json)")
    p.add_argument("--tenant", default="default", help="name of the tenant created when there is no tenants file")
    p.add_argument("--default-k", type=int, help="memories retrieved when a request does not say (default 20)")
    p.add_argument("--default-mode", choices=MODES, help="default memory mode (kv)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, help="format memories are encoded in (INFERSCALE_KV_DTYPE, default bf16)")
    p.add_argument("--console-traces", action="store_true", default=None, help="also print spans to stdout")


def settings_from_args(args: argparse.Namespace):
    from inferscale.server.settings import Settings

    return Settings.from_env(host=args.host, port=args.port, internal_port=getattr(args, "internal_port", None),
                             model=args.model, device=args.device, engine=getattr(args, "engine", None),
                             data_dir=args.data_dir, tenants_file=args.tenants_file, default_k=args.default_k,
                             default_mode=args.default_mode, console_traces=args.console_traces,
                             kv_dtype=getattr(args, "kv_dtype", None))


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from inferscale.server.app import check_engine, create_app
    from inferscale.server.auth import TENANT_RE, create_tenants_file
    from inferscale.server.logs import uvicorn_log_config

    settings = settings_from_args(args)
    check_engine(settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    path = settings.tenants_path
    if not path.exists():
        if not TENANT_RE.match(args.tenant):
            raise ConfigError(f"--tenant {args.tenant!r}: must be a DNS label (lowercase letters, digits, '-')")
        try:
            key = create_tenants_file(path, args.tenant)
        except OSError as e:
            raise ConfigError(f"tenants file {path}: cannot create ({e.strerror or e})") from None
        print(f"Created {path} with tenant {args.tenant!r}. Its API key (shown once, stored hashed):\n\n    {key}\n")
        print(f"Try:  INFERSCALE_API_KEY={key} inferscale demo --url http://{_client_host(settings.host)}:{settings.port}\n")
    print(f"Loading {settings.model} and the retrieval embedder...", flush=True)
    app = create_app(settings)
    print(f"InferScale serving {settings.model} on http://{settings.host}:{settings.port}  (store: {settings.store_dir}, "
          f"tenants: {', '.join(app.state.tenants.names)})", flush=True)
    # INFO by default: access logs (route templates, server/accesslog.py) are how operators see traffic; -v adds
    # debug. Each line carries trace ids. uvicorn's own access log would print the raw path: off.
    level = "debug" if logging.getLogger().level <= logging.DEBUG else "info"

    def listener(asgi_app, port: int, **kw) -> uvicorn.Server:
        return uvicorn.Server(uvicorn.Config(asgi_app, host=settings.host, port=port, access_log=False,
                                             log_config=uvicorn_log_config(level),
                                             timeout_graceful_shutdown=settings.shutdown_grace_s, **kw))

    servers = [listener(app, settings.port)]
    internal_app = app.state.internal_app
    if internal_app is not None:  # else single node: the tenant API only
        tls = settings.fleet_tls
        scheme = "http" if tls is None else "https"
        print(f"Internal API (operator only) on {scheme}://{settings.host}:{settings.internal_port}/internal/v1",
              flush=True)
        servers.append(listener(internal_app, settings.internal_port, lifespan="off", **internal_tls_options(tls)))
    worker = app.state.worker
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(serve_together(servers, engine_alive=lambda: worker.alive))


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (the server extra brings it and httptools, which uvicorn then parses
    HTTP with, as ``uvicorn[standard]`` does), else asyncio's (None). Every streamed token is a socket write and a few
    callbacks on this loop, on the cores the engine decodes on: with 16 streams on the 2-core Zen 4 machine a socket
    write, the loop's bookkeeping and h11 were most of the loop's CPU (py-spy), and with uvloop and httptools the
    loop thread took a third less CPU for the same tokens and the 16-stream step was ~10 % shorter
    (docs/bench/HISTORY.md, "the serving loop on uvloop")."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def internal_tls_options(tls: FleetTls | None) -> dict[str, Callable]:
    """uvicorn.Config options of the internal listener: TLS with the fleet certificate (taken up again when the
    mounted files change) when the fleet has one, else none (plain HTTP)."""
    if tls is None:
        return {}
    return {"ssl_context_factory": lambda _config, _default: tls.reloading_server_context(verify_clients=False)}


async def serve_together(servers: list, engine_alive: Callable[[], bool] | None = None) -> int:
    """Run uvicorn servers in one event loop (one process, shared store and engine); when one stops (a signal, a
    failed bind) or the engine stops on its own (``engine_alive()`` turns false), stop them all (each answers what
    it has open first, within its graceful-shutdown timeout). The exit status: EXIT_ENGINE_FAILED when the engine
    stopped first, else 0."""
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    watch = asyncio.create_task(_engine_failed(servers, engine_alive)) if engine_alive is not None else None
    try:
        await asyncio.wait([*tasks, *([watch] if watch else [])], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for s in servers:
            s.should_exit = True
        if watch is not None and not watch.done():
            watch.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if watch is not None and not watch.cancelled() and watch.result():
        log.critical("the engine failed: exiting with status %d so that the container is restarted",
                     EXIT_ENGINE_FAILED)
        return EXIT_ENGINE_FAILED
    return 0


async def _engine_failed(servers: list, engine_alive: Callable[[], bool], poll_s: float = 0.1) -> bool:
    """True once the engine stops while no listener was asked to (a shutdown closes the engine too: not a failure)."""
    while True:
        if any(s.should_exit for s in servers):
            return False
        if not engine_alive():
            return True
        await asyncio.sleep(poll_s)


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


if __name__ == "__main__":
    from inferscale.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
