"""What the apps' handlers reach through ``request.app.state``: one typed container per app instead of untyped
attributes. ``create_app`` sets ``app.state`` to a ``Services`` (the internal app's to an ``InternalServices``), so
``request.app.state.memories`` is a ``MemoryService`` a type checker and a reader can follow."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from inferscale.engine.engine import Engine
from inferscale.engine.backend import EngineBackend
from inferscale.retrieval import Embedder
from inferscale.server.auth import TenantRegistry
from inferscale.server.memories import MemoryService
from inferscale.server.settings import Settings
from inferscale.server.tracing import Telemetry
from inferscale.store import KVStore
from inferscale.store.fleet import Fleet


@dataclass
class InternalServices:
    """The internal plane's app (operator -> server): settings, the node's store and its fleet path."""

    settings: Settings
    store: KVStore
    fleet: Fleet


@dataclass
class Services:
    """The tenant app's services, built once by ``create_app``."""

    settings: Settings
    engine: Engine
    store: KVStore
    embedder: Embedder
    tenants: TenantRegistry
    telemetry: Telemetry
    worker: EngineBackend  # the engine seam: the PyTorch loop's worker or the TensorRT-LLM backend
    memories: MemoryService
    fleet: Fleet  # the fleet path: shared with the internal app (peers, purges)
    started: float  # unix time the app was built (model cards' ``created``)
    model_ids: list[str]  # the names /v1/chat/completions answers to
    modes: list[str]  # the injection modes this build serves
    internal_app: FastAPI | None = None  # the internal listener's app, when INFERSCALE_INTERNAL_TOKEN is set
