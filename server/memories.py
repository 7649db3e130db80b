"""Memories: the tenant API (``/v1/memories/{user}``) and the service behind it and behind retrieval.

Every store call names the caller's tenant, which comes only from its API key: a user id means nothing outside
its tenant, so another tenant's user is simply not found.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Annotated, Any, AsyncIterator

import torch
from fastapi import APIRouter, Depends, Path, Request
from opentelemetry import trace

from inferscale.contract import USER_MAX_LEN, user_store_id
from inferscale.engine.template import MemoryItem
from inferscale.errors import InferScaleError, NotFoundError
from inferscale.kvformat import KVBlock
from inferscale.retrieval import injection_order, top_k
from inferscale.server.auth import Tenant, require_tenant
from inferscale.server.fleet import fleet_for
from inferscale.server.httperrors import ApiError
from inferscale.server.schemas import (ID_PATTERN, ErrorBody, MemoryInfo, MemoryList, PutMemories, PutMemoriesResult,
                                       Removed)

ENCODE_CHUNK = 16  # items per engine call, so decoding interleaves with a large upload
META_CHUNK = 64  # blocks opened at once to read stored memories' text and context


def _count(removed: Any) -> int:
    return removed if isinstance(removed, int) else len(removed or [])


def fetch_tiers(stats: Any) -> dict[str, int]:
    """Tier -> blocks from a store's FetchStats (a ``tiers`` dict, or one ``<tier>`` count attribute per tier)."""
    tiers = getattr(stats, "tiers", None)
    if isinstance(tiers, dict):
        return {str(k): int(v) for k, v in tiers.items() if v}
    out = {}
    for name in ("gpu", "dram", "disk", "peer"):
        v = getattr(stats, name, None)
        if isinstance(v, int) and v:
            out[name] = v
    return out


class UserLocks:
    """One asyncio lock per (tenant, user), held by every PUT and DELETE of that user's memories, so they apply in
    one order: a PUT racing a DELETE cannot store back what the DELETE removed, and ``replace`` racing another PUT
    cannot encode an item behind memories being removed. The map holds only keys someone holds or waits for (so it
    is bounded by the requests in flight) and loses each key when its last holder leaves."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, list[int]]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str, user: str) -> AsyncIterator[None]:
        key = (tenant, user)
        lock, refs = self._locks.setdefault(key, (asyncio.Lock(), [0]))
        refs[0] += 1
        try:
            async with lock:
                yield
        finally:
            refs[0] -= 1
            if refs[0] == 0:
                del self._locks[key]


def _too_large(message: str, code: str, param: str = "items") -> ApiError:
    return ApiError(413, message, code=code, param=param)


class MemoryService:
    def __init__(self, store, embedder, worker, engine, meters=None) -> None:
        self.store, self.embedder, self.worker, self.engine, self.meters = store, embedder, worker, engine, meters
        self.locks = UserLocks()

    @property
    def fingerprint(self) -> str:
        return self.engine.loaded.fingerprint

    async def put(self, tenant: Tenant, user: str, body: PutMemories) -> PutMemoriesResult:
        """Add the items to the end of the user's list; an id already stored is replaced in place. Each item is
        encoded behind the memories before it in that list, and the stored items encoded behind a replaced one are
        encoded again (see inferscale/engine/encoder.py)."""
        t0 = time.perf_counter()
        ids = [i.id for i in body.items]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ApiError(400, f"duplicate memory id(s): {', '.join(dupes[:5])}", param="items", code="duplicate_id")
        async with self.locks.hold(tenant.name, user):  # one writer per user: see UserLocks
            return await self._put(tenant, user, body, ids, t0)

    async def _put(self, caller: Tenant, user: str, body: PutMemories, ids: list[str], t0: float) -> PutMemoriesResult:
        budget = await self._check_budgets(caller, user, body, ids)
        tenant = caller.name
        new = {i.id: MemoryItem(id=i.id, text=i.text, timestamp=i.timestamp or None) for i in body.items}
        stored = [] if body.replace else await asyncio.to_thread(self._stored, tenant, user)
        order = [info_id(i) for i in stored]
        known = set(order)
        order += [i for i in ids if i not in known]
        infos = {info_id(i): i for i in stored}
        nbytes = await self._encode(tenant, user, order, [order.index(i) for i in ids],
                                    lambda i: new[i] if i in new else self._item(tenant, user, infos[i]), budget)
        removed = 0
        if body.replace:
            keep = set(ids)
            for info in await asyncio.to_thread(self.store.list, tenant, user):
                if info_id(info) not in keep:
                    removed += _count(await asyncio.to_thread(self.store.delete, tenant, user, info_id(info)))
        if self.meters is not None:
            self.meters.encoded(len(ids))
        return PutMemoriesResult(user=user, encoded=len(ids), removed=removed, bytes=nbytes,
                                 seconds=round(time.perf_counter() - t0, 4))

    async def _check_budgets(self, tenant: Tenant, user: str, body: PutMemories, ids: list[str]) -> "DiskBudget":
        """Refuse before any work: more memories than the tenant may store (413), more encode tokens than its
        per-minute budget could ever hold (413) or holds now (429 + Retry-After). Returns the disk budget the
        writes are checked against."""
        items, disk = await asyncio.to_thread(self.store.usage, tenant.name)
        mine = {info_id(i): int(getattr(i, "size", 0) or 0) for i in await asyncio.to_thread(self._all, tenant.name, user)}
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
        return DiskBudget(tenant.max_disk_bytes, disk, {i: mine[i] for i in ids if i in mine})

    def _all(self, tenant: str, user: str) -> list[Any]:
        try:
            return self.store.list(tenant, user)
        except NotFoundError:
            return []

    def _count_tokens(self, texts: list[str]) -> int:
        """Memory tokens of an upload, counted off the engine thread (a stand-in count where no tokenizer is)."""
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            return sum(len(t.encode()) for t in texts) // 4 + len(texts)
        return sum(len(ids) for ids in tok(texts, add_special_tokens=False).input_ids)

    async def _encode(self, tenant: str, user: str, order: list[str], changed: list[int], item_of,
                      budget: "DiskBudget | None" = None) -> int:
        """Encode the items at positions ``changed`` of the list ``order`` (and the items behind them), each behind
        its predecessors; store the blocks. Only the stretches around changed items are read."""
        m = self.engine.context_items
        spans: list[list[int]] = []  # [first, last) around changed positions, merged where they overlap
        for pos in sorted(changed):
            lo, hi = max(0, pos - m), min(len(order), pos + m + 1)
            if spans and lo <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], hi)
            else:
                spans.append([lo, hi])
        wanted = {order[p] for p in changed}
        nbytes = 0
        for lo, hi in spans:
            listed = await asyncio.to_thread(lambda a=lo, b=hi: [item_of(i) for i in order[a:b]])
            at = [n for n, i in enumerate(listed) if i.id in wanted]
            for start in range(0, len(at), ENCODE_CHUNK):  # chunks, so decoding interleaves with a big upload
                chunk = {listed[n].id for n in at[start:start + ENCODE_CHUNK]}
                # Up to the next chunk's first item: the items behind this chunk that the next one will not encode.
                cut = at[start + ENCODE_CHUNK] if start + ENCODE_CHUNK < len(at) else len(listed)
                blocks = await self.worker.call(
                    lambda eng, li=listed[:cut], c=chunk: eng.encode(li, only=c, embed=self.embedder.embed))
                if budget is not None:
                    budget.charge(blocks)  # 413 before this chunk touches the disk; earlier chunks are kept
                for b in blocks:
                    await asyncio.to_thread(self.store.put, tenant, user, b)
                    nbytes += b.nbytes
        return nbytes

    def _stored(self, tenant: str, user: str) -> list[Any]:
        """The user's stored memories for this model, in list order; none for a user without memories."""
        try:
            return self._ordered(self.store.list(tenant, user))
        except NotFoundError:
            return []

    def _ordered(self, infos: list[Any]) -> list[Any]:
        """Of a user's store rows, those of this model, in list order (first stored first)."""
        return sorted((i for i in infos if not getattr(i, "corrupt", False)
                       and getattr(i, "fingerprint", self.fingerprint) == self.fingerprint),
                      key=lambda i: (getattr(i, "created", 0.0), info_id(i)))

    def _read_meta(self, tenant: str, user: str, infos: list[Any]) -> dict[str, dict[str, Any]]:
        """id -> text, timestamp and extra (a dict) of stored memories, read from the opened blobs: a server's
        blobs are sealed, so a file header says nothing in plain form. Another model's items, or a chunk that
        cannot be opened: the plain header where there is one (library stores), else nothing."""
        out: dict[str, dict[str, Any]] = {}
        mine = [info_id(i) for i in infos if getattr(i, "fingerprint", None) == self.fingerprint
                and not getattr(i, "corrupt", False)]
        for start in range(0, len(mine), META_CHUNK):  # bounded DRAM for a long list
            try:
                blocks, _ = self.store.get_many(tenant, user, mine[start:start + META_CHUNK], self.fingerprint)
            except InferScaleError:
                continue
            out.update({b.item_id: {"text": b.text, "timestamp": b.timestamp, "extra": dict(b.extra)} for b in blocks})
        for info in infos:
            if info_id(info) not in out:
                meta: dict[str, Any] = dict(blob_meta(getattr(info, "path", None)))
                try:
                    meta["extra"] = json.loads(meta.get("extra") or "{}")
                except ValueError:
                    meta["extra"] = {}
                out[info_id(info)] = meta
        return out

    def _item(self, tenant: str, user: str, info: Any) -> MemoryItem:
        meta = self._read_meta(tenant, user, [info]).get(info_id(info), {})
        if not meta.get("text"):
            raise NotFoundError(f"memory {info_id(info)!r}: its blob header cannot be read")
        return MemoryItem(id=info_id(info), text=meta["text"], timestamp=meta.get("timestamp") or None)

    async def list(self, tenant: str, user: str) -> MemoryList:
        def run() -> list[MemoryInfo]:
            rows = self.store.list(tenant, user)
            metas = self._read_meta(tenant, user, rows)
            return [to_info(i, metas.get(info_id(i))) for i in rows]

        return MemoryList(user=user, items=await asyncio.to_thread(run))

    async def delete(self, tenant: str, user: str, item_id: str | None = None) -> Removed:
        async with self.locks.hold(tenant, user):
            return await self._delete(tenant, user, item_id)

    async def _delete(self, tenant: str, user: str, item_id: str | None) -> Removed:
        everything = await asyncio.to_thread(self.store.list, tenant, user)  # NotFoundError for an unknown user
        infos = everything if item_id is None else [i for i in everything if info_id(i) == item_id]
        if item_id is not None and not infos:
            raise NotFoundError(f"memory {item_id!r} of user {user!r} not found")
        stored = self._ordered(everything)
        behind = [] if item_id is None else await asyncio.to_thread(self._encoded_behind, tenant, user, stored,
                                                                     item_id)
        nbytes = sum(int(to_info(i).bytes or 0) for i in infos)
        removed = _count(await asyncio.to_thread(self.store.delete, tenant, user, item_id))
        if behind:  # a deleted memory must not live on in the KV of the memories encoded behind it
            by_id = {info_id(i): i for i in stored if info_id(i) != item_id}
            order = list(by_id)
            await self._encode(tenant, user, order, [order.index(i) for i in behind],
                               lambda i: self._item(tenant, user, by_id[i]))
        return Removed(removed_blocks=removed, removed_bytes=nbytes)

    def _encoded_behind(self, tenant: str, user: str, stored: list[Any], item_id: str) -> list[str]:
        """Of the ``stored`` memories (in list order), those whose blocks were encoded with ``item_id`` in their
        context (only the next context_items memories can be)."""
        out = []
        pos = next((n for n, i in enumerate(stored) if info_id(i) == item_id), len(stored))
        window = stored[pos + 1 : pos + 1 + self.engine.context_items]
        metas = self._read_meta(tenant, user, window)
        for info in window:
            extra = metas.get(info_id(info), {}).get("extra") or {}
            context = str(extra.get("context", "")) if isinstance(extra, dict) else ""
            if item_id in context.split(","):
                out.append(info_id(info))
        return out

    async def retrieve(self, tenant: str, user: str, query: str, k: int, tracer: trace.Tracer,
                       ctx: Any) -> tuple[list[KVBlock], list[str]]:
        """Top-k of the user's memories for ``query``, fetched from the store (spans: retrieval, kv_fetch).

        Returns (blocks in injection order: least relevant first, ids best first)."""
        with tracer.start_as_current_span("retrieval", context=ctx, attributes={"inferscale.k": k}) as span:
            # The fleet path (server/fleet.py): local, else this node's Job dir, else a peer's index.
            fleet = fleet_for(self.store)
            ids, matrix = await asyncio.to_thread(fleet.embeddings, tenant, user, self.fingerprint)
            span.set_attribute("inferscale.candidates", len(ids))
            if not ids or k <= 0:
                chosen = []
            else:
                q = await asyncio.to_thread(self.embedder.embed, [query])
                chosen = [i for i, _ in top_k(q[0], ids, torch.as_tensor(matrix), k)]
            span.set_attribute("inferscale.retrieved", len(chosen))
        if not chosen:
            return [], []
        with tracer.start_as_current_span("kv_fetch", context=ctx) as span:
            got = await asyncio.to_thread(fleet.blocks, tenant, user, injection_order(chosen), self.fingerprint)
            blocks, stats = got.blocks, got.stats
            tiers = fetch_tiers(stats)
            if got.pulled_blocks:  # leased from a peer over NIXL UCX just now (then served from DRAM)
                tiers["dram"] = tiers.get("dram", 0) - got.pulled_blocks
                tiers["peer"] = got.pulled_blocks
                tiers = {t: n for t, n in tiers.items() if n > 0}
                span.set_attribute("inferscale.kv.peer_bytes", got.pulled_bytes)
            nbytes = int(getattr(stats, "bytes", 0) or sum(b.nbytes for b in blocks))
            span.set_attribute("inferscale.kv.tier", ",".join(sorted(tiers)) or "none")
            span.set_attribute("inferscale.kv.bytes", nbytes)
            span.set_attribute("inferscale.kv.blocks", len(blocks))
            for tier, n in tiers.items():
                span.set_attribute(f"inferscale.kv.blocks.{tier}", n)
            if self.meters is not None:
                self.meters.kv_fetched(",".join(sorted(tiers)) or "none", nbytes)
        return blocks, chosen


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


def info_id(info: Any) -> str:
    return info["id"] if isinstance(info, dict) else getattr(info, "item_id", None) or getattr(info, "id")


def blob_meta(path: str | None) -> dict[str, str]:
    """The metadata of a KV blob (text, timestamp, ...) from its safetensors header alone."""
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 1 << 24:
                return {}
            return json.loads(f.read(n)).get("__metadata__", {})
    except (OSError, ValueError):
        return {}


def to_info(info: Any, meta: dict[str, Any] | None = None) -> MemoryInfo:
    """A store ItemInfo (inferscale.store.ItemInfo) as the API shows it; text and timestamp from ``meta`` (the
    opened blob, MemoryService._read_meta), else from a plain blob header."""
    get = info.get if isinstance(info, dict) else lambda k, d=None: getattr(info, k, d)
    meta = meta if meta is not None else blob_meta(get("path"))
    # No tier: where a block sits moves with every tenant's traffic (DRAM/GPU LRUs), so showing it would let
    # one tenant watch the others' activity. Only the item's own stable facts are shown.
    return MemoryInfo(id=info_id(info), tokens=get("tokens"), bytes=get("kv_bytes", get("bytes")),
                      text=meta.get("text", get("text")),
                      timestamp=meta.get("timestamp") or get("timestamp"))


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
