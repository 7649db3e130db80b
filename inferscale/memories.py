"""A user's memories as one list: its order, encoding each item behind the ones before it, re-encoding the items
behind an edited or deleted one, listing, and retrieval. No HTTP here: server/memories.py maps requests to it.

Order is the store's ``created`` (first stored first; a re-put keeps its place). The items an item was encoded
behind are catalogued with it (``ItemInfo.context``), so a delete finds the items to re-encode without opening a
blob. Memory text lives only inside the (sealed) blobs: re-encoding and listing read it through ``KVStore.get_many``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from inferscale.engine.engine import Engine
from inferscale.engine.template import MemoryItem
from inferscale.errors import InferScaleError, NotFoundError
from inferscale.kvformat import KVBlock
from inferscale.retrieval import Embedder, injection_order, top_k
from inferscale.store import ItemInfo, KVStore
from inferscale.store.results import FetchStats

ENCODE_CHUNK = 16  # items per engine call, so decoding interleaves with a large upload
READ_CHUNK = 64  # blocks opened at once to read stored memories' text (bounded DRAM for a long list)

# Called with the blocks of one encoded chunk before any of them is written; raises to refuse the write.
Charge = Callable[[list[KVBlock]], None]
# Called under the user's write lock with all of the user's store rows (every model) before any work; raises to
# refuse the upload, or returns the Charge its writes are checked against.
Admit = Callable[[list[ItemInfo]], Awaitable[Charge | None]]

T = TypeVar("T")


class EngineWorker(Protocol):
    """The thread that owns the model (inferscale.engine.worker.EngineWorker)."""

    async def call(self, fn: Callable[[Engine], T]) -> T: ...

    @property
    def active(self) -> int: ...  # requests it is serving

    @property
    def queued(self) -> int: ...  # requests and calls waiting for it


@dataclass(frozen=True)
class Memory:
    """One stored memory as its owner sees it. No tier: where a block sits moves with every tenant's traffic, so
    showing it would let one tenant watch the others' activity."""

    id: str
    tokens: int
    bytes: int  # KV bytes
    text: str | None  # None for an item of another model or one that cannot be opened
    timestamp: str | None


@dataclass(frozen=True)
class PutOutcome:
    encoded: int  # items of the upload
    removed: int  # blocks removed by ``replace``
    bytes: int  # KV bytes written, re-encoded neighbours included


@dataclass(frozen=True)
class RemoveOutcome:
    blocks: int
    bytes: int  # KV bytes of the removed items


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


class MemoryBook:
    """The memories of every user of one node's store, for the engine's model."""

    def __init__(self, store: KVStore, embedder: Embedder, worker: EngineWorker, engine: Engine) -> None:
        self.store, self.embedder, self.worker, self.engine = store, embedder, worker, engine
        self.locks = UserLocks()

    @property
    def fingerprint(self) -> str:
        return self.engine.loaded.fingerprint

    # -- reads ----------------------------------------------------------------------------------------------
    def rows(self, tenant: str, user: str) -> list[ItemInfo]:
        """All of the user's store rows (every model); none for a user without memories."""
        try:
            return self.store.list(tenant, user)
        except NotFoundError:
            return []

    def ordered(self, rows: list[ItemInfo]) -> list[ItemInfo]:
        """Of a user's store rows, the usable ones of this model, in list order (first stored first)."""
        mine = (r for r in rows if not r.corrupt and r.fingerprint == self.fingerprint)
        return sorted(mine, key=lambda r: (r.created, r.item_id))

    def read(self, tenant: str, user: str, item_ids: list[str]) -> dict[str, MemoryItem]:
        """id -> the stored item (text, timestamp) of those of ``item_ids`` that open; the others are left out."""
        out: dict[str, MemoryItem] = {}
        for start in range(0, len(item_ids), READ_CHUNK):
            chunk = item_ids[start:start + READ_CHUNK]
            try:
                blocks, _ = self.store.get_many(tenant, user, chunk, self.fingerprint)
            except InferScaleError:  # one bad item must not hide the chunk: open them one by one
                blocks = []
                for i in chunk:
                    with contextlib.suppress(InferScaleError):
                        blocks += self.store.get_many(tenant, user, [i], self.fingerprint)[0]
            out.update({b.item_id: MemoryItem(b.item_id, b.text, b.timestamp or None) for b in blocks})
        return out

    async def list(self, tenant: str, user: str) -> list[Memory]:
        """The user's memories (NotFoundError for a user without any), text read from the opened blobs."""
        def run() -> list[Memory]:
            rows = self.store.list(tenant, user)
            opened = self.read(tenant, user, [r.item_id for r in self.ordered(rows)])
            return [Memory(r.item_id, r.tokens, r.kv_bytes, getattr(opened.get(r.item_id), "text", None),
                           getattr(opened.get(r.item_id), "timestamp", None)) for r in rows]

        return await asyncio.to_thread(run)

    # -- writes ---------------------------------------------------------------------------------------------
    async def put(self, tenant: str, user: str, items: list[MemoryItem], *, replace: bool = False,
                  admit: Admit | None = None) -> PutOutcome:
        """Add ``items`` (unique ids) to the end of the user's list; an id already stored is replaced in place.
        Each item is encoded behind the memories before it, and the stored items encoded behind a replaced one
        are encoded again. ``replace``: the list becomes exactly ``items``."""
        async with self.locks.hold(tenant, user):  # one writer per user: see UserLocks
            rows = await asyncio.to_thread(self.rows, tenant, user)
            charge = None if admit is None else await admit(rows)
            new = {i.id: i for i in items}
            order = [] if replace else [r.item_id for r in self.ordered(rows)]
            known = set(order)
            order += [i for i in new if i not in known]
            nbytes = await self._encode(tenant, user, order, [order.index(i) for i in new], new, charge)
            removed = 0
            if replace:
                gone = sorted({r.item_id for r in rows} - set(new))
                if gone:
                    removed, _ = await asyncio.to_thread(self.store.purge, tenant, user, gone)
                # The list is the upload, in its order: a kept id must not keep its old place (it was encoded
                # behind the upload's items before it, and the next edit reads the order from the catalogue).
                await asyncio.to_thread(self.store.reorder, tenant, user, self.fingerprint, order)
            return PutOutcome(encoded=len(items), removed=removed, bytes=nbytes)

    async def delete(self, tenant: str, user: str, item_id: str | None = None) -> RemoveOutcome:
        """Remove one memory (every model's block of it) or all of the user's; NotFoundError when absent. The
        memories encoded behind a removed one are encoded again: it must not live on in their KV."""
        async with self.locks.hold(tenant, user):
            rows = await asyncio.to_thread(self.store.list, tenant, user)  # NotFoundError for an unknown user
            hit = rows if item_id is None else [r for r in rows if r.item_id == item_id]
            if not hit:
                raise NotFoundError(f"memory {item_id!r} of user {user!r} not found")
            stored = self.ordered(rows)
            behind = [] if item_id is None else [r.item_id for r in stored if item_id in r.context]
            removed = await asyncio.to_thread(self.store.delete, tenant, user, item_id)
            if behind:
                order = [r.item_id for r in stored if r.item_id != item_id]
                await self._encode(tenant, user, order, [order.index(i) for i in behind], {}, None)
            return RemoveOutcome(blocks=removed, bytes=sum(r.kv_bytes for r in hit))

    async def _encode(self, tenant: str, user: str, order: list[str], changed: list[int],
                      new: dict[str, MemoryItem], charge: Charge | None) -> int:
        """Encode the items at positions ``changed`` of the list ``order`` (and the items behind them), each behind
        its predecessors; store the blocks. Only the stretches around changed items are read: ``new`` items as
        given, stored ones from their blobs."""
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
            listed = await asyncio.to_thread(self._items, tenant, user, order[lo:hi], new)
            at = [n for n, i in enumerate(listed) if i.id in wanted]
            for start in range(0, len(at), ENCODE_CHUNK):  # chunks, so decoding interleaves with a big upload
                chunk = {listed[n].id for n in at[start:start + ENCODE_CHUNK]}
                # Up to the next chunk's first item: the items behind this chunk that the next one will not encode.
                cut = at[start + ENCODE_CHUNK] if start + ENCODE_CHUNK < len(at) else len(listed)
                blocks = await self.worker.call(
                    lambda eng, li=listed[:cut], c=chunk: eng.encode(li, only=c, embed=self.embedder.embed))
                if charge is not None:
                    charge(blocks)  # refused before this chunk touches the disk; earlier chunks are kept
                for b in blocks:
                    await asyncio.to_thread(self.store.put, tenant, user, b)
                    nbytes += b.nbytes
        return nbytes

    def _items(self, tenant: str, user: str, ids: list[str], new: dict[str, MemoryItem]) -> list[MemoryItem]:
        stored = self.read(tenant, user, [i for i in ids if i not in new])
        missing = [i for i in ids if i not in new and i not in stored]
        if missing:
            raise NotFoundError(f"memories {missing[:5]} of user {user!r} cannot be opened to re-encode")
        return [new[i] if i in new else stored[i] for i in ids]

    # -- retrieval ------------------------------------------------------------------------------------------
    def search(self, tenant: str, user: str, query: str, k: int) -> tuple[list[str], int]:
        """(the ids of the user's k memories most relevant to ``query``, best first; candidates considered)."""
        ids, matrix = self.store.embeddings(tenant, user, self.fingerprint)
        return self.rank(tenant, query, ids, matrix, k), len(ids)

    def rank(self, tenant: str, query: str, ids: list[str], matrix: torch.Tensor, k: int) -> list[str]:
        """The ids of the k candidates (``ids`` with their embedding rows ``matrix``) most relevant to ``query``,
        best first. The candidates come from this pod's store or, on the fleet path, a peer's index. Concurrent
        queries of one tenant are embedded in one batch (``Embedder.embed_query``)."""
        if not ids or k <= 0:
            return []
        q = self.embedder.embed_query(query, tenant)
        return [i for i, _ in top_k(q, ids, matrix, k)]

    def text_tokens(self, tenant: str, user: str, k: int) -> int:
        """The memory tokens a text request pastes before its question, known before retrieval picks them: k of the
        user's memories at their mean size (all of them when fewer; none stored here, 0). One aggregate query of the
        catalogue (the names come checked: the tenant from its key, the user through ``user_store_id``)."""
        n, tokens = self.store.catalogue.user_tokens(tenant, user, self.fingerprint)
        return round(tokens * min(k, n) / n) if n else 0

    def fetch(self, tenant: str, user: str, chosen: list[str]) -> tuple[list[KVBlock], FetchStats]:
        """The blocks of ``chosen`` (ids best first) in injection order (least relevant first)."""
        return self.store.get_many(tenant, user, injection_order(chosen), self.fingerprint)
