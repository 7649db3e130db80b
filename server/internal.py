"""``/internal/v1/*``: what the operator calls to make this pod pull a user's blocks, drop them, or report capacity
(docs/interfaces.md, "Serving pod internal API"). Bearer ``INFERSCALE_INTERNAL_TOKEN``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from inferscale.server.auth import require_internal
from inferscale.server.schemas import Capacity, ErrorBody, PullRequest, PullResult, PurgeRequest, Removed

router = APIRouter(prefix="/internal/v1", tags=["internal"], dependencies=[Depends(require_internal)],
                   responses={s: {"model": ErrorBody} for s in (400, 401, 404, 424)})


def _pull(store, settings, req: PullRequest):
    src = req.source
    if src.peer is None or src.node == settings.node_name:  # the encoding Job's output is on this node
        return store.import_dir(req.tenant, req.user, src.dir, req.items)
    return store.pull_from_peer(req.tenant, req.user, src.peer, req.items)


@router.post("/pull", response_model=PullResult)
async def pull(req: PullRequest, request: Request) -> PullResult:
    """Load the user's blobs into this pod's store (from ``source.dir`` on this node, else from the peer's NIXL
    agent). Idempotent. Answers the user's totals on this pod after the pull."""
    st = request.app.state
    await asyncio.to_thread(_pull, st.store, st.settings, req)
    infos = await asyncio.to_thread(st.store.list, req.tenant, req.user)  # totals after the pull
    tier = "gpu" if st.settings.gpu_budget_bytes > 0 and getattr(st.store, "gpu", None) is not None else "dram"
    return PullResult(tenant=req.tenant, user=req.user, blocks=len(infos), bytes=sum(i.size for i in infos),
                      tokens=sum(i.tokens for i in infos), tier=tier)


@router.post("/purge", response_model=Removed)
async def purge(req: PurgeRequest, request: Request) -> Removed:
    """Remove the user's blocks (or just ``items``) from every tier of this pod. Idempotent: 0 when absent."""
    st = request.app.state
    blocks, nbytes = await asyncio.to_thread(st.store.purge, req.tenant, req.user, req.items)
    return Removed(removed_blocks=blocks, removed_bytes=nbytes)


@router.get("/capacity", response_model=Capacity)
async def capacity(request: Request) -> Capacity:
    st = request.app.state
    stats = await asyncio.to_thread(st.store.stats)
    s = st.settings
    return Capacity(node=s.node_name, pod=s.pod_name or s.node_name, bytes_used=int(stats.get("bytes_used", 0)),
                    bytes_capacity=int(stats.get("bytes_capacity", s.dram_budget_bytes)), users=int(stats.get("users", 0)))
