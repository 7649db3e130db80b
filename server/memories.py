"""Memories: the tenant API (``/v1/memories/{user}``), mapped onto the memory domain (inferscale/memories.py).

Every store call names the caller's tenant, which comes only from its API key: a user id means nothing outside
its tenant, so another tenant's user is simply not found. What lives here is HTTP and tenant policy only: the
request/response shapes, the tenant's budgets (413/429 before any work), metrics and the retrieval spans.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import APIRouter, Depends, Path, Request
from opentelemetry import trace
from opentelemetry.context import Context

from inferscale.contract import USER_MAX_LEN, user_store_id
from inferscale.engine.template import MemoryItem
from inferscale.kvformat import KVBlock
from inferscale.engine.engine import Engine
from inferscale.memories import Charge, EngineWorker, Memory, MemoryBook
from inferscale.retrieval import Embedder, injection_order
from inferscale.store import ItemInfo, KVStore
from inferscale.server.auth import Tenant, require_tenant
from inferscale.store.fetcher import Fetcher, Planned, default_planner, resident_tiers
from inferscale.store.fleet import Fleet
from inferscale.server.genai_metrics import ServerMetrics
from inferscale.server.httperrors import ApiError
from inferscale.server.schemas import (ID_PATTERN, ErrorBody, MemoryInfo, MemoryList, PutMemories, PutMemoriesResult,
                                       Removed)


def _too_large(message: str, code: str, param: str = "items") -> ApiError:
    return ApiError(413, message, code=code, param=param)


T = TypeVar("T")


class MemoryService:
    """The memory domain (``book``) behind the routes and chat's retrieval, with the tenant's budgets and metrics."""

    def __init__(self, store: KVStore, embedder: Embedder, worker: EngineWorker, engine: Engine,
                 meters: ServerMetrics | None = None, fleet: Fleet | None = None) -> None:
        self.book = MemoryBook(store, embedder, worker, engine)
        self.store, self.engine, self.meters, self.worker = store, engine, meters, worker
        self.fleet = fleet if fleet is not None else Fleet(store)  # the pod's one fleet (server/app.py)
        # fetch or recompute each retrieved block (inferscale/store/fetcher.py), never one the engine reads in place
        self.fetcher = Fetcher(self.fleet, default_planner(resident_tiers(engine.device.type)))
        self.locks = self.book.locks
        self._borrowing = False  # a retrieval is running on the engine's thread (``_on_idle_cores``)

    @property
    def fingerprint(self) -> str:
        return self.book.fingerprint

    async def _on_idle_cores(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the engine's thread while it serves nothing, else on a side thread. The engine's thread computes
        on every core (its OpenMP pool); a side thread on one (engine/threads.py: a second pool would slow every
        decode step). A query's embedding took 15-21 ms on one core and 10-13 on two (issue 22): a request arriving
        at an idle server gets the faster one; under load it runs beside the engine's steps as before. One call at
        a time borrows the engine's thread, whose calls run in order: a burst arriving at an idle server had every
        retrieval queued there, and another tenant's question arriving 0.3 s later waited behind 30 of them (0.9 s)
        instead of taking its turn at the embedder (retrieval.Embedder.embed_query)."""
        if self._borrowing or self.worker.active or self.worker.queued:
            return await asyncio.to_thread(fn)
        self._borrowing = True
        try:
            return await self.worker.call(lambda _engine: fn())
        finally:
            self._borrowing = False

    @property
    def embedder(self) -> Embedder:  # the book's: tests swap in a slow one to widen race windows
        return self.book.embedder

    @embedder.setter
    def embedder(self, embedder: Embedder) -> None:
        self.book.embedder = embedder

    async def put(self, tenant: Tenant, user: str, body: PutMemories) -> PutMemoriesResult:
        """Add the items to the end of the user's list; an id already stored is replaced in place (see
        MemoryBook.put)."""
        t0 = time.perf_counter()
        ids = [i.id for i in body.items]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ApiError(400, f"duplicate memory id(s): {', '.join(dupes[:5])}", param="items", code="duplicate_id")
        items = [MemoryItem(id=i.id, text=i.text, timestamp=i.timestamp or None) for i in body.items]

        async def admit(rows: list[ItemInfo]) -> Charge:
            return await self._check_budgets(tenant, body, ids, rows)

        done = await self.book.put(tenant.name, user, items, replace=body.replace, admit=admit)
        if self.meters is not None:
            self.meters.encoded(len(ids))
        return PutMemoriesResult(user=user, encoded=done.encoded, removed=done.removed, bytes=done.bytes,
                                 seconds=round(time.perf_counter() - t0, 4))

    async def _check_budgets(self, tenant: Tenant, body: PutMemories, ids: list[str],
                             rows: list[ItemInfo]) -> Charge:
        """Refuse before any work: more memories than the tenant may store (413), more encode tokens than its
        per-minute budget could ever hold (413) or holds now (429 + Retry-After). Returns the disk budget the
        writes are checked against. ``rows``: the user's store rows, read under its write lock."""
        items, disk = await asyncio.to_thread(self.store.usage, tenant.name)
        mine = {r.item_id: r.size for r in rows}
        gone = set(mine) if body.replace else set()
        after = items - len(gone) + len([i for i in ids if i not in mine or i in gone])
        if after > tenant.max_memories:
            raise _too_large(f"tenant would hold {after} memories on this server, over its limit of "
                             f"{tenant.max_memories}", "memory_limit_exceeded")
        if disk >= tenant.max_disk_bytes:
            raise _too_large(f"tenant already stores {disk} bytes, its disk budget is {tenant.max_disk_bytes}",
                             "disk_quota_exceeded")
        tokens = await asyncio.to_thread(self._count_tokens, [i.text for i in body.items])
        if tokens > tenant.encode_tokens_per_minute:
            raise _too_large(f"{tokens} memory tokens exceed this tenant's encode budget of "
                             f"{tenant.encode_tokens_per_minute} per minute; upload in smaller parts",
                             "encode_budget_exceeded")
        wait = tenant.take_encode_tokens(tokens)
        if wait > 0:
            raise ApiError(429, f"encode budget of {tenant.encode_tokens_per_minute} tokens per minute is spent; "
                           f"retry in {wait:.1f} s", type="rate_limit_error", code="encode_rate_exceeded",
                           param="items", headers={"Retry-After": str(max(1, int(wait + 0.999)))})
        return DiskBudget(tenant.max_disk_bytes, disk, {i: mine[i] for i in ids if i in mine}).charge

    def _count_tokens(self, texts: list[str]) -> int:
        """Memory tokens of an upload, counted off the engine thread."""
        return sum(len(ids) for ids in self.engine.tokenizer(texts, add_special_tokens=False).input_ids)

    async def list(self, tenant: str, user: str) -> MemoryList:
        return MemoryList(user=user, items=[to_info(m) for m in await self.book.list(tenant, user)])

    async def delete(self, tenant: str, user: str, item_id: str | None = None) -> Removed:
        done = await self.book.delete(tenant, user, item_id)
        return Removed(removed_blocks=done.blocks, removed_bytes=done.bytes)

    async def text_tokens(self, tenant: str, user: str, k: int) -> int:
        """What ``k`` of the user's memories add to a text request's prompt (MemoryBook.text_tokens), off the loop."""
        return await asyncio.to_thread(self.book.text_tokens, tenant, user, k)

    async def retrieve(self, tenant: str, user: str, query: str, k: int, tracer: trace.Tracer,
                       ctx: Context | None, prompt_token_s: float | None = None) -> tuple[Planned, list[str]]:
        """Top-k of the user's memories for ``query``, each fetched from the store or planned for recompute
        (spans: retrieval, kv_fetch). ``prompt_token_s``: the engine's measured prefill cost (None: fetch all).

        Returns (the fetched blocks and the memories to recompute, each in injection order: least relevant first;
        ids best first)."""
        with tracer.start_as_current_span("retrieval", context=ctx, attributes={"inferscale.k": k}) as span:
            # The fleet path (inferscale/store/fleet.py): this pod's store, else this node's Job dir, else a peer's.
            fleet = self.fleet

            def rank() -> tuple[int, list[str]]:  # one hop to a worker thread, not two (each ~0.2 ms or more)
                ids, matrix = fleet.embeddings(tenant, user, self.book.fingerprint)
                return len(ids), self.book.rank(tenant, query, ids, matrix, k)

            candidates, chosen = await self._on_idle_cores(rank)
            span.set_attribute("inferscale.candidates", candidates)
            span.set_attribute("inferscale.retrieved", len(chosen))
        if not chosen:
            return Planned([], [], None), []
        with tracer.start_as_current_span("kv_fetch", context=ctx) as span:
            planned = await asyncio.to_thread(self.fetcher.fetch, tenant, user, injection_order(chosen),
                                              self.book.fingerprint, prompt_token_s)
            blocks, stats, got = planned.blocks, planned.stats, planned.fetched
            tiers = {tier: n for tier, n in stats.tiers.items() if n}
            if got is not None and got.pulled_blocks:  # leased from a peer over NIXL UCX just now (then from DRAM)
                tiers["dram"] = tiers.get("dram", 0) - got.pulled_blocks
                tiers["peer"] = got.pulled_blocks
                tiers = {t: c for t, c in tiers.items() if c > 0}
                span.set_attribute("inferscale.kv.peer_bytes", got.pulled_bytes)
            span.set_attribute("inferscale.kv.tier", ",".join(sorted(tiers)) or "none")
            span.set_attribute("inferscale.kv.bytes", stats.bytes)
            span.set_attribute("inferscale.kv.blocks", len(blocks))
            span.set_attribute("inferscale.kv.recomputed_blocks", len(planned.recompute))
            for tier, n in tiers.items():
                span.set_attribute(f"inferscale.kv.blocks.{tier}", n)
            span.set_attributes(planned.attributes())
            if self.meters is not None:
                self.meters.kv_fetched(",".join(sorted(tiers)) or "none", stats.bytes)
        return planned, chosen


class DiskBudget:
    """A tenant's disk bytes during one upload: each chunk of blocks is charged before it is written."""

    def __init__(self, limit: int, used: int, replaced: dict[str, int]) -> None:
        self.limit, self.used, self.replaced = limit, used, dict(replaced)

    def charge(self, blocks: list[KVBlock]) -> None:
        grow = sum(b.nbytes - self.replaced.pop(b.item_id, 0) for b in blocks)
        if self.used + grow > self.limit:
            raise _too_large(f"storing these memories needs {self.used + grow} bytes on disk, over this tenant's "
                             f"budget of {self.limit}", "disk_quota_exceeded")
        self.used += grow


def to_info(memory: Memory) -> MemoryInfo:
    return MemoryInfo(id=memory.id, tokens=memory.tokens, bytes=memory.bytes, text=memory.text,
                      timestamp=memory.timestamp)


# ---- routes -------------------------------------------------------------------------------------------------
router = APIRouter(prefix="/v1/memories", tags=["memories"])
# The OpenAI `user` string (an e-mail works), mapped to the store id as chat maps it (contract.user_store_id).
UserPath = Annotated[str, Path(min_length=1, max_length=USER_MAX_LEN,
                               description="the user (chat's `user`), scoped to the caller's tenant")]
ItemPath = Annotated[str, Path(pattern=ID_PATTERN)]
TenantDep = Annotated[Tenant, Depends(require_tenant)]
ERRORS = {s: {"model": ErrorBody} for s in (400, 401, 404, 413, 429)}


def _svc(request: Request) -> MemoryService:
    return request.app.state.memories


@router.put("/{user}", response_model=PutMemoriesResult, responses=ERRORS)
async def put_memories(user: UserPath, body: PutMemories, request: Request, tenant: TenantDep) -> PutMemoriesResult:
    """Encode the items now (KV through the engine, embeddings for retrieval) and store them; same ids replace."""
    return await _svc(request).put(tenant, user_store_id(user), body)


@router.get("/{user}", response_model=MemoryList, responses=ERRORS)
async def get_memories(user: UserPath, request: Request, tenant: TenantDep) -> MemoryList:
    return await _svc(request).list(tenant.name, user_store_id(user))


@router.delete("/{user}", response_model=Removed, responses=ERRORS)
async def delete_user(user: UserPath, request: Request, tenant: TenantDep) -> Removed:
    """Delete all of the user's memories from every tier."""
    return await _svc(request).delete(tenant.name, user_store_id(user))


@router.delete("/{user}/{item}", response_model=Removed, responses=ERRORS)
async def delete_item(user: UserPath, item: ItemPath, request: Request, tenant: TenantDep) -> Removed:
    return await _svc(request).delete(tenant.name, user_store_id(user), item)
