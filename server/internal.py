"""``/internal/v1/*``: what the operator calls to make this pod pull a user's blocks, drop them, or report capacity
(docs/interfaces.md, "Serving pod internal API"). Bearer ``INFERSCALE_INTERNAL_TOKEN``."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from inferscale.errors import NotFoundError, UnsafePathError
from inferscale.jobpaths import job_dir_path
from inferscale.kvformat import SUFFIX
from inferscale.server.auth import require_internal
from inferscale.store.fleet import MAX_PEERS
from inferscale.server.schemas import (Capacity, ErrorBody, PeerAddress, PullRequest, PullResult, Purged,
                                       PurgeRequest)

router = APIRouter(prefix="/internal/v1", tags=["internal"], dependencies=[Depends(require_internal)],
                   responses={s: {"model": ErrorBody} for s in (400, 401, 404, 424)})


def _pull(store, settings, req: PullRequest):
    src = req.source
    if src.peer is None and _holds(store, req.tenant, req.user, req.items):
        return None  # the Job delivered them here (server/ingest.py): nothing to read
    if src.peer is None and src.dir is None:
        raise NotFoundError(f"user {req.user!r} of tenant {req.tenant!r}: these items were not delivered to this pod "
                            "and the pull names no peer")
    if src.peer is None or src.node == settings.node_name:  # the encoding Job's output is on this node
        # The same rule as purge's source_dir (inferscale/jobpaths.py), checked before anything is read.
        path = job_dir_path(settings.kv_host_path, req.tenant, req.user, src.dir, param="source.dir")
        try:
            return store.import_dir(req.tenant, req.user, path, req.items)
        except UnsafePathError as e:  # a symlink or hard link inside the dir (store/jobdir.py)
            e.param = e.param or "source.dir"
            raise
    # The peer checks the dir against its own INFERSCALE_KV_HOST_PATH with the same rule before importing it.
    return store.pull_from_peer(req.tenant, req.user, src.peer, req.items, source_dir=src.dir)


def _holds(store, tenant: str, user: str, items: list[str] | None) -> bool:
    """Whether this pod already holds all of these items of the user (``items`` None: the whole dir, unknown)."""
    if not items:
        return False
    have = {r.item_id for r in store.catalogue.items(tenant, user) if not r.corrupt}
    return set(items) <= have


@router.post("/pull", response_model=PullResult)
async def pull(req: PullRequest, request: Request) -> PullResult:
    """Load the user's blobs into this pod's store (from ``source.dir`` on this node, else from the peer's NIXL
    agent). Idempotent. Answers the user's totals on this pod after the pull."""
    st = request.app.state
    await asyncio.to_thread(_pull, st.store, st.settings, req)
    infos = await asyncio.to_thread(st.store.list, req.tenant, req.user)  # totals after the pull
    return PullResult(tenant=req.tenant, user=req.user, blocks=len(infos), bytes=sum(i.size for i in infos),
                      tokens=sum(i.tokens for i in infos), tier=pod_tier(st))


def pod_tier(st) -> Literal["dram", "gpu"]:
    """The fastest tier this pod keeps a user's blocks in, as pull and ingest report it."""
    return "gpu" if st.settings.gpu_budget_bytes > 0 and getattr(st.store, "gpu", None) is not None else "dram"


def _remove_items(path: Path, items: list[str]) -> bool:
    """Delete just these items' blobs from a Job output dir (hygiene after an edit removed them); False when the
    dir was not there. Names are item ids (schema-checked), so no path escapes the dir."""
    try:  # the dir itself is not followed if it was swapped for a symlink after the path check
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        for item in items:
            try:
                os.unlink(f"{item}{SUFFIX}", dir_fd=fd)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)
    return True


def _remove_dir(path: Path) -> bool:
    """Delete ``path`` and everything below it; False when it was not there (a concurrent purge got it first)."""
    if not path.is_dir():
        return False
    for _ in range(3):  # another pod on this node may be removing the same files: what it took is gone either way
        try:
            shutil.rmtree(path)
            break
        except FileNotFoundError:
            if not path.exists():
                break
    return True


@router.post("/purge", response_model=Purged, response_model_exclude_none=True)
async def purge(req: PurgeRequest, request: Request) -> Purged:
    """Remove the user's blocks (or just ``items``) from every tier of this pod. Idempotent: 0 when absent.
    With ``source_dir``, also delete that encoding-Job output dir on this node (only ``<kv host path>/<tenant>/<user>``:
    anything else is a 400, checked before anything is removed)."""
    st = request.app.state
    src = job_dir_path(st.settings.kv_host_path, req.tenant, req.user, req.source_dir) if req.source_dir else None
    blocks, nbytes = await asyncio.to_thread(st.store.purge, req.tenant, req.user, req.items)
    await asyncio.to_thread(st.fleet.forget, req.tenant, req.user)  # no stale peer index survives
    removed_dir = None
    if src is not None:  # with items: only their blobs leave the Job dir (the other items still serve from it)
        removed_dir = await asyncio.to_thread(*((_remove_items, src, req.items) if req.items else (_remove_dir, src)))
    return Purged(removed_blocks=blocks, removed_bytes=nbytes, source_dir_removed=removed_dir)


class PeersRequest(BaseModel):
    """The other serving pods' peer addresses (``podIP:INFERSCALE_NIXL_PORT``), as the operator sees them."""
    peers: list[PeerAddress] = Field(default_factory=list, max_length=MAX_PEERS)


class Peers(BaseModel):
    peers: list[str]


@router.put("/peers", response_model=Peers)
async def put_peers(req: PeersRequest, request: Request) -> Peers:
    """Replace the peers this pod asks, in turn, for a user it lacks (inferscale/store/fleet.py). Only the operator (internal
    token) sets them: a tenant can never point a pod at a peer of its choosing."""
    return Peers(peers=request.app.state.fleet.set_peers(req.peers))


@router.get("/peers", response_model=Peers)
async def get_peers(request: Request) -> Peers:
    return Peers(peers=list(request.app.state.fleet.peers))


@router.get("/capacity", response_model=Capacity)
async def capacity(request: Request) -> Capacity:
    st = request.app.state
    stats = await asyncio.to_thread(st.store.stats)
    s = st.settings
    return Capacity(node=s.node_name, pod=s.pod_name or s.node_name, bytes_used=int(stats.get("bytes_used", 0)),
                    bytes_capacity=int(stats.get("bytes_capacity", s.dram_budget_bytes)), users=int(stats.get("users", 0)))
