"""The FastAPI app factory: ``create_app(settings, engine=None, store=None)``; tests inject a tiny engine."""

from __future__ import annotations

import contextlib
import logging
import time

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inferscale import __version__
from inferscale.contract import MODES
from inferscale.server import chat, httperrors, internal, memories
from inferscale.server.auth import TenantRegistry, require_tenant
from inferscale.server.httperrors import response as error_response
from inferscale.server.scheduler import EngineWorker
from inferscale.server.schemas import ModelCard, ModelList
from inferscale.server.settings import Settings
from inferscale.server.logs import inject_trace_ids_into_logs
from inferscale.server.tracing import setup as setup_telemetry

log = logging.getLogger(__name__)


def open_store(settings: Settings):
    """The tiered store. With an internal token (cluster mode) it also serves peers on INFERSCALE_NIXL_PORT.
    Blobs are sealed at rest under INFERSCALE_KEK_FILE; when unset, ``<data_dir>/kek`` (created 0600 on first
    start). A cluster needs the chart's KEK: encoding Jobs seal with it and imports only open what it sealed."""
    from inferscale.sealing import Keyring, ensure_kek_file
    from inferscale.store import KVStore

    cluster = bool(settings.internal_token)
    if settings.kek_file is not None:
        keyring = Keyring.load(settings.kek_file)
    else:
        if cluster:
            log.warning("INFERSCALE_KEK_FILE is not set: blobs from encoding Jobs will not open here")
        keyring = ensure_kek_file(settings.kek_path)
    return KVStore(settings.store_dir, dram_budget_bytes=settings.dram_budget_bytes,
                   gpu_budget_bytes=settings.gpu_budget_bytes, node=settings.node_name, device=settings.device,
                   peer_port=settings.nixl_port if cluster else None, peer_token=settings.internal_token,
                   keyring=keyring)


class BodyLimit:
    """Pure ASGI middleware: 413 for bodies over the limit (by Content-Length). Request counts and latencies by
    route template come from the OpenTelemetry instrumentation (``http.server.*``), never by raw path."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    too_big = int(v) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    resp = error_response(413, f"request body over {self.limit} bytes", "invalid_request_error",
                                          "request_too_large")
                    return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(settings: Settings | None = None, *, engine=None, store=None, embedder=None, tenants=None,
               span_exporter=None, metric_reader=None) -> FastAPI:
    settings = settings or Settings.from_env()
    if engine is None:
        from inferscale.engine import Engine

        engine = Engine.load(settings.model, device=settings.device, kv_dtype=settings.kv_dtype)
    if embedder is None:
        from inferscale.retrieval import Embedder

        embedder = Embedder()
    owns_store = store is None
    store = store if store is not None else open_store(settings)
    tenants = tenants or TenantRegistry(settings.tenants_path, max_k=settings.max_k, max_tokens=settings.max_tokens,
                                        max_in_flight=settings.max_in_flight)
    worker = EngineWorker(engine, max_active=settings.max_active, max_prefills_per_round=settings.max_prefills_per_round)
    telemetry = setup_telemetry(console=settings.console_traces, span_exporter=span_exporter,
                                metric_reader=metric_reader, load=lambda: (worker.active, worker.queued))
    inject_trace_ids_into_logs()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        worker.close()
        telemetry.shutdown()
        if owns_store and hasattr(store, "close"):
            store.close()

    app = FastAPI(title="InferScale", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible chat completions with per-user memories injected as KV state.")
    st = app.state
    st.settings, st.engine, st.store, st.embedder, st.tenants = settings, engine, store, embedder, tenants
    st.telemetry, st.worker, st.started = telemetry, worker, time.time()
    st.model_ids = [settings.model] + ([engine.loaded.name] if engine.loaded.name != settings.model else [])
    st.modes = list(MODES)
    st.memories = memories.MemoryService(store, embedder, worker, engine, telemetry.metrics)
    httperrors.install(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.include_router(chat.router)
    app.include_router(memories.router)
    app.include_router(internal.router)
    telemetry.instrument(app)

    @app.get("/v1/models", response_model=ModelList, tags=["models"], dependencies=[Depends(require_tenant)])
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model, created=int(st.started))])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, tags=["models"],
             dependencies=[Depends(require_tenant)])
    async def get_model(model_id: str) -> ModelCard:
        if model_id not in st.model_ids:
            raise httperrors.ApiError(404, f"model {model_id!r} does not exist", code="model_not_found", param="model")
        return ModelCard(id=settings.model, created=int(st.started))

    @app.get("/healthz", tags=["ops"])
    async def healthz():
        if not worker.alive:
            return error_response(503, "engine worker is not running", "server_error", "unhealthy")
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz():
        if not worker.alive:
            return error_response(503, "engine worker is not running", "server_error", "not_ready")
        return {"status": "ready", "model": settings.model, "active": worker.active, "queued": worker.queued}

    @app.get("/metrics", tags=["ops"], response_class=Response)
    async def prometheus_metrics():
        return Response(generate_latest(telemetry.prometheus), media_type=CONTENT_TYPE_LATEST)

    return app


__all__ = ["create_app", "open_store", "JSONResponse"]
