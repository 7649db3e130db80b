"""A memory's record: its text, timestamp and token ids, kept in the catalogue beside its sealed embedding, so that
the request path can recompute a memory's tokens without reading its KV blob (the fetch-or-recompute planner,
inferscale/store/fetcher.py). Written when the blob is stored (put, import, peer pull, rebuild), from the blob's
own metadata; sealed like the embedding in a sealed store (inferscale/store/versions.py, field ``memory``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from inferscale.errors import BlobCorruptError
from inferscale.store.blob import BlobInfo


@dataclass(frozen=True)
class MemoryRecord:
    item_id: str
    text: str
    timestamp: str | None
    token_ids: tuple[int, ...]  # the item's rendered tokens, what text mode prefills for it (the blob's own)


def record_bytes(info: BlobInfo) -> bytes:
    """The plain record of a blob, from its metadata."""
    meta = info.meta
    return json.dumps({"text": meta.get("text", ""), "timestamp": meta.get("timestamp") or None,
                       "token_ids": json.loads(meta.get("token_ids", "[]"))}, separators=(",", ":")).encode()


def parse_record(item_id: str, plain: bytes) -> MemoryRecord:
    try:
        d = json.loads(plain)
        ids = tuple(int(t) for t in d["token_ids"])
        return MemoryRecord(item_id, str(d["text"]), d.get("timestamp") or None, ids)
    except (ValueError, KeyError, TypeError):
        raise BlobCorruptError(f"memory record of item {item_id!r} is not a record") from None
