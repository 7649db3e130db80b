"""``/internal/v1/*``: what the operator calls to make this pod pull a user's blocks, drop them, or report capacity
(docs/interfaces.md, "Serving pod internal API"). Bearer ``INFERSCALE_INTERNAL_TOKEN``."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

from fastapi import APIRouter, Depends, Request

from inferscale.errors import NotFoundError
from inferscale.server.auth import require_internal
from inferscale.server.memories import info_id
from inferscale.server.schemas import Capacity, ErrorBody, PullRequest, PullResult, PurgeRequest, Removed

router = APIRouter(prefix="/internal/v1", tags=["internal"], dependencies=[Depends(require_internal)],
                   responses={s: {"model": ErrorBody} for s in (400, 401, 404, 502)})


def _list(store, tenant: str, user: str) -> list:
    try:
        return list(store.list(tenant, user))
    except NotFoundError:
        return []


def _bytes(infos: list) -> int:
    return sum(int((i.get("bytes") if isinstance(i, dict) else getattr(i, "bytes", 0)) or 0) for i in infos)


def _pull(store, settings, req: PullRequest) -> None:
    src = req.source
    local = src.peer is None or src.node == settings.node_name
    if local:
        directory = Path(src.dir)
        if not directory.is_dir():
            raise NotFoundError(f"source dir {src.dir} not found on node {settings.node_name}")
        params = inspect.signature(store.import_dir).parameters
        if req.items is not None and "item_ids" in params:
            store.import_dir(req.tenant, req.user, directory, item_ids=req.items)
        else:
            store.import_dir(req.tenant, req.user, directory)
    else:
        store.pull_from_peer(req.tenant, req.user, src.peer, req.items)


@router.post("/pull", response_model=PullResult)
async def pull(req: PullRequest, request: Request) -> PullResult:
    """Load the user's blobs into this pod's store (from ``source.dir`` on this node, else from the peer). Idempotent."""
    st = request.app.state
    await asyncio.to_thread(_pull, st.store, st.settings, req)
    infos = await asyncio.to_thread(_list, st.store, req.tenant, req.user)
    if req.items is not None:
        wanted = set(req.items)
        infos = [i for i in infos if info_id(i) in wanted]
    return PullResult(tenant=req.tenant, user=req.user, blocks=len(infos), bytes=_bytes(infos),
                      tier="gpu" if st.settings.gpu_budget_bytes > 0 else "dram")


@router.post("/purge", response_model=Removed)
async def purge(req: PurgeRequest, request: Request) -> Removed:
    """Remove the user's blocks (or just ``items``) from every tier of this pod. Idempotent: 0 when absent."""
    store = request.app.state.store

    def run() -> Removed:
        infos = _list(store, req.tenant, req.user)
        targets = infos if req.items is None else [i for i in infos if info_id(i) in set(req.items)]
        if not targets:
            return Removed(removed_blocks=0, removed_bytes=0)
        if req.items is None:
            store.delete(req.tenant, req.user)
        else:
            for i in targets:
                store.delete(req.tenant, req.user, info_id(i))
        return Removed(removed_blocks=len(targets), removed_bytes=_bytes(targets))

    return await asyncio.to_thread(run)


@router.get("/capacity", response_model=Capacity)
async def capacity(request: Request) -> Capacity:
    st = request.app.state
    stats = await asyncio.to_thread(st.store.stats)
    get = stats.get if isinstance(stats, dict) else lambda k, d=None: getattr(stats, k, d)
    s = st.settings
    used = int(get("bytes_used", None) or (get("dram_bytes", 0) or 0) + (get("gpu_bytes", 0) or 0))
    return Capacity(node=s.node_name, pod=s.pod_name or s.node_name, bytes_used=used,
                    bytes_capacity=s.dram_budget_bytes + s.gpu_budget_bytes, users=int(get("users", 0) or 0))
