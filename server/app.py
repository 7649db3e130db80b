"""The FastAPI app factory: ``create_app(settings, engine=None, store=None)``; tests inject a tiny engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from inferscale import __version__
from inferscale.server import chat, httperrors, ingest, internal, memories, openapi, ops
from inferscale.server.accesslog import RouteAccessLog
from inferscale.server.auth import TenantRegistry, require_tenant
from inferscale.server.gcheap import startup_heap_frozen
from inferscale.server.guard import TenantGuard
from inferscale.engine.scheduler import SchedulerConfig
from inferscale.engine.threads import on_own_thread, pin_threads
from inferscale.engine.worker import EngineWorker
from inferscale.engine.backend import EngineBackend
from inferscale.server.schemas import MODELS, ModelCard, ModelList, ModelProfile
from inferscale.server.services import InternalServices, Services
from inferscale.server.settings import Settings
from inferscale.server.logs import inject_trace_ids_into_logs
from inferscale.server.tracing import setup as setup_telemetry
from inferscale.server.warmup import warm_up
from inferscale.store.fleet import Fleet

if TYPE_CHECKING:  # loaded lazily below: the model and store are built only when not injected
    from inferscale.engine import Engine
    from inferscale.retrieval import Embedder
    from inferscale.store import KVStore

log = logging.getLogger(__name__)
# The side executor's threads (retrieval, fetches): created as needed; most of them wait, on the embedder or a disk.
SIDE_THREADS = 128


def open_store(settings: Settings):
    """The tiered store. With a peer secret (cluster mode) it also serves peers on INFERSCALE_NIXL_PORT, MACed
    with that secret; it imports a peer-named Job dir only from INFERSCALE_KV_HOST_PATH. Blobs are sealed at rest
    under INFERSCALE_KEK_FILE; when unset, ``<data_dir>/kek`` (created 0600 on first start). A cluster needs the
    chart's KEK: encoding Jobs seal with it and imports only open what it sealed."""
    from inferscale.sealing import Keyring, ensure_kek_file
    from inferscale.store import KVStore

    cluster = bool(settings.peer_secret)
    if settings.kek_file is not None:
        keyring = Keyring.load(settings.kek_file)
    else:
        if cluster or settings.internal_token:
            log.warning("INFERSCALE_KEK_FILE is not set: blobs from encoding Jobs will not open here")
        keyring = ensure_kek_file(settings.kek_path)
    return KVStore(settings.store_dir, dram_budget_bytes=settings.dram_budget_bytes,
                   gpu_budget_bytes=settings.gpu_budget_bytes, node=settings.node_name, device=settings.device,
                   peer_port=settings.nixl_port if cluster else None, peer_host=settings.host,
                   peer_secret=settings.peer_secret, peer_tls=settings.fleet_tls,
                   job_root=settings.kv_host_path, ucx_port_range=settings.ucx_port_range, keyring=keyring)


def check_engine(settings: Settings) -> None:
    """Refuse, before anything loads, an engine this install cannot run (``ConfigError``, one line)."""
    if settings.engine == "trtllm":
        from inferscale.trtllm.backend import require_tensorrt_llm

        require_tensorrt_llm()


def open_backend(settings: Settings, engine: Engine) -> EngineBackend:
    """The engine seam's backend ``settings.engine`` names (inferscale/engine/backend.py)."""
    kv_tokens = settings.kv_cache_bytes // engine.kv_token_bytes  # INFERSCALE_KV_CACHE_BYTES, in the model's tokens
    # held back for tenants with nothing running: one arriving finds room for the largest request there can be
    # beside the other tenants' (capacity.py)
    kv_reserve = min(kv_tokens // 2, engine.loaded.layout.max_positions)
    if settings.engine == "trtllm":
        from inferscale.trtllm.backend import TrtllmBackend, TrtllmOptions

        return TrtllmBackend(engine, TrtllmOptions(
            model=settings.trtllm_model or settings.model, tokens_per_block=settings.trtllm_tokens_per_block,
            max_in_flight_per_tenant=settings.max_active + settings.max_queued_per_tenant, max_kv_tokens=kv_tokens,
            kv_reserve_tokens=kv_reserve, max_batch_size=settings.max_active, queue_timeout_s=settings.queue_timeout_s))
    return EngineWorker(engine, SchedulerConfig(
        max_running=settings.max_active, step_tokens=settings.step_tokens, chunk_tokens=settings.chunk_tokens,
        max_queued_per_tenant=settings.max_queued_per_tenant, queue_timeout_s=settings.queue_timeout_s,
        step_time_s=settings.step_time_s, kv_tokens=kv_tokens, kv_reserve_tokens=kv_reserve),
        slots=settings.kv_slots, slot_tokens=settings.kv_slot_tokens)


def plane_credentials(settings: Settings) -> dict[str, str]:
    """The internal token, peer secret and metrics token that are set, by the variable that holds them."""
    creds = {"INFERSCALE_INTERNAL_TOKEN": settings.internal_token, "INFERSCALE_PEER_SECRET": settings.peer_secret,
             "INFERSCALE_METRICS_TOKEN": settings.metrics_token}
    return {k: v for k, v in creds.items() if v}


def create_internal_app(settings: Settings, store, telemetry, fleet: Fleet) -> FastAPI:
    """The internal plane: only ``/internal/v1/*`` (Bearer INFERSCALE_INTERNAL_TOKEN), served on its own
    listener (INFERSCALE_INTERNAL_PORT) over the tenant app's store. The tenant port has no such route."""
    app = FastAPI(title="InferScale internal", version=__version__, docs_url=None, redoc_url=None,
                  description="Operator -> serving pod: pull, purge, capacity.")
    app.state = InternalServices(settings=settings, store=store, fleet=fleet)  # type: ignore[assignment]
    httperrors.install(app)
    # No tenants here: size, and the operator's token before the body is read.
    # A Job's delivery (server/ingest.py) has its own credential and limit, checked there before the body too.
    app.add_middleware(TenantGuard, limit=settings.max_body_bytes, internal_token=settings.internal_token,
                       upload_check=ingest.upload_checker(settings.internal_token or ""),
                       upload_limit=settings.ingest_max_bytes)
    app.include_router(internal.router, responses=httperrors.ERROR_RESPONSES)
    app.include_router(ingest.router, responses=httperrors.ERROR_RESPONSES)
    openapi.install(app, MODELS)
    telemetry.instrument(app)
    app.add_middleware(RouteAccessLog)
    return app


def open_services(settings: Settings, engine: Engine | None, embedder: Embedder | None,
                  store: KVStore | None) -> tuple[Engine, Embedder, KVStore, EngineBackend]:
    """The engine, retrieval embedder and store (those not given: loaded) and the engine's backend."""
    if engine is None:
        from inferscale.engine import Engine

        engine = Engine.load(settings.model, device=settings.device, kv_dtype=settings.kv_dtype,
                             threads=settings.torch_threads)
    if embedder is None:
        from inferscale.retrieval import Embedder

        embedder = Embedder()
    store = store if store is not None else open_store(settings)
    return engine, embedder, store, open_backend(settings, engine)


def create_app(settings: Settings | None = None, *, engine: Engine | None = None, store: KVStore | None = None,
               embedder: Embedder | None = None, tenants: TenantRegistry | None = None,
               span_exporter=None, metric_reader=None) -> FastAPI:
    settings = settings or Settings.from_env()
    check_engine(settings)
    tenants = tenants or TenantRegistry(settings.tenants_path, max_k=settings.max_k, max_tokens=settings.max_tokens,
                                        max_in_flight=settings.max_in_flight, budgets=settings.tenant_budgets)
    # A tenant API key must never be a plane credential: refuse to start if one is (and any later file with one).
    tenants.forbid(plane_credentials(settings))
    owns_store = store is None
    # Built on a thread that ends: no OpenMP pool stays behind on this one (inferscale/engine/threads.py)
    engine, embedder, store, worker = on_own_thread(open_services, settings, engine, embedder, store)
    # Each tenant's DRAM share, again after every tenants-file reload.
    tenants.watch(lambda ts: [store.set_tenant_quota(t.name, t.dram_bytes) for t in ts])
    telemetry = setup_telemetry(console=settings.console_traces, span_exporter=span_exporter,
                                metric_reader=metric_reader, load=lambda: (worker.active, worker.queued),
                                steps=lambda: worker.step_totals, kv_usage=lambda: worker.kv_usage)
    inject_trace_ids_into_logs()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        # The event loop and its worker threads (retrieval's embedding, fetches) run torch on one core each: only
        # the engine thread computes on all of them (inferscale/engine/threads.py)
        pin_threads(1)
        # Enough threads that one tenant's burst does not queue another's retrieval behind it here: a retrieval
        # mostly waits for the embedder, which serves tenants in turn (retrieval.Embedder.embed_query); with the
        # default six, 13 of one tenant's long questions held another's short one ~0.7 s before it reached it.
        side = concurrent.futures.ThreadPoolExecutor(SIDE_THREADS, thread_name_prefix="inferscale-io",
                                                     initializer=pin_threads, initargs=(1,))
        asyncio.get_running_loop().set_default_executor(side)
        log.info("warmed up in %.2f s", await warm_up(worker, embedder.embed_query, settings.max_active,
                                                        settings.default_k))  # before it listens
        with startup_heap_frozen():  # full collections skip what lives as long as the app (gcheap.py)
            yield
        side.shutdown(wait=False)
        worker.close()
        telemetry.shutdown()
        if owns_store:
            store.close()

    app = FastAPI(title="InferScale", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible chat completions with per-user memories injected as KV state.")
    fleet = Fleet(store)  # one per pod: the tenant routes and the internal plane share its peers and indexes
    st = Services(settings=settings, engine=engine, store=store, embedder=embedder, tenants=tenants,
                  telemetry=telemetry, worker=worker, fleet=fleet,
                  memories=memories.MemoryService(store, embedder, worker, engine, telemetry.metrics, fleet),
                  started=time.time(), modes=list(worker.modes),
                  model_ids=[settings.model] + ([engine.loaded.name] if engine.loaded.name != settings.model else []))
    app.state = st  # type: ignore[assignment]  # typed: handlers read request.app.state.<service>
    httperrors.install(app)
    # Size, API key and in-flight slot are checked before any body byte is read (server/guard.py).
    app.add_middleware(TenantGuard, limit=settings.max_body_bytes, tenants=tenants)
    app.include_router(chat.router, responses=httperrors.ERROR_RESPONSES)
    app.include_router(memories.router, responses=httperrors.ERROR_RESPONSES)
    app.include_router(ops.router, responses=httperrors.ERROR_RESPONSES)
    openapi.install(app, MODELS)
    telemetry.instrument(app)
    app.add_middleware(RouteAccessLog)  # outermost: it sees every answer, the guard's refusals included
    st.internal_app = create_internal_app(settings, store, telemetry, fleet) if settings.internal_token else None

    def model_card() -> ModelCard:  # the inferscale field shows the profile: its default stop and modes
        profile = ModelProfile(default_stop=list(engine.template.default_stop), modes=st.modes)
        return ModelCard(id=settings.model, created=int(st.started), inferscale=profile)

    @app.get("/v1/models", response_model=ModelList, tags=["models"], dependencies=[Depends(require_tenant)],
             responses=httperrors.ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, tags=["models"],
             dependencies=[Depends(require_tenant)], responses=httperrors.ERROR_RESPONSES)
    async def get_model(model_id: str) -> ModelCard:
        if model_id not in st.model_ids:
            raise httperrors.ApiError(404, f"model {model_id!r} does not exist", code="model_not_found", param="model")
        return model_card()

    return app


__all__ = ["check_engine", "create_app", "create_internal_app", "open_backend", "open_store", "JSONResponse"]
