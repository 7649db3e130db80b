"""The node's catalogue: one SQLite file listing every item, its size, checksum, pin and corrupt flags, its current generation (with the row's MAC, in a sealed store), its retrieval
embedding and its memory record (text and token ids, what a recompute needs without the blob; both sealed in a
sealed store: inferscale/store/versions.py).

Disk is the source of truth: the catalogue is rebuilt from the blobs when missing or unreadable. Residency in
DRAM/GPU is the tiers' own (volatile) state: the columns ``dram``, ``gpu`` and ``last_access`` of older releases are
no longer written, so a read writes nothing here. The file and its WAL/SHM are 0600."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
  tenant TEXT NOT NULL, user TEXT NOT NULL, fingerprint TEXT NOT NULL, item TEXT NOT NULL,
  path TEXT NOT NULL, size INTEGER NOT NULL, kv_bytes INTEGER NOT NULL, tokens INTEGER NOT NULL,
  sha256 TEXT NOT NULL, dram INTEGER NOT NULL DEFAULT 0, gpu INTEGER NOT NULL DEFAULT 0,
  last_access REAL NOT NULL DEFAULT 0, pinned INTEGER NOT NULL DEFAULT 0, corrupt INTEGER NOT NULL DEFAULT 0,
  embedding BLOB, created REAL NOT NULL, context TEXT NOT NULL DEFAULT '',
  generation INTEGER NOT NULL DEFAULT 0, row_mac TEXT NOT NULL DEFAULT '', memory BLOB,
  PRIMARY KEY (tenant, user, fingerprint, item)
);
CREATE INDEX IF NOT EXISTS items_tenant_user ON items (tenant, user);
"""
COLS = ("tenant, user, fingerprint, item, path, size, kv_bytes, tokens, sha256, dram, gpu, last_access, pinned, corrupt,"
        " created, context, generation, row_mac")
CONTEXT_SEP = ","  # context ids are valid ids (inferscale.contract), which never hold a comma


@dataclass
class ItemInfo:
    """One catalogued item, as ``KVStore.list`` returns it."""

    tenant: str
    user: str
    fingerprint: str
    item_id: str
    path: str
    size: int  # bytes of the blob (what moves between tiers)
    kv_bytes: int
    tokens: int
    sha256: str
    tiers: list[str] = field(default_factory=list)  # fastest first, of "gpu", "dram", "disk"
    last_access: float = 0.0
    pinned: bool = False
    corrupt: bool = False
    created: float = 0.0  # orders a user's memories: first stored first
    # Ids of the memories this item was encoded behind (its KV depends on them): a delete re-encodes the items
    # naming the deleted one without opening any blob. Ids only: memory text lives only in the sealed blobs.
    context: tuple[str, ...] = ()
    generation: int = 0  # the current sealed version (inferscale/store/versions.py); 0 in an unsealed store
    row_mac: str = ""  # authenticates (key, generation, sha256, size) in a sealed store

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.tenant, self.user, self.fingerprint, self.item_id)


def _info(row: tuple) -> ItemInfo:
    t, u, fp, item, path, size, kvb, tok, sha, dram, gpu, last, pinned, corrupt, created, context, gen, mac = row
    tiers = [name for name, on in (("gpu", gpu), ("dram", dram), ("disk", 1)) if on]
    return ItemInfo(t, u, fp, item, path, size, kvb, tok, sha, tiers, last, bool(pinned), bool(corrupt), created,
                    tuple(i for i in context.split(CONTEXT_SEP) if i), gen, mac)


class Catalogue:
    """Thread-safe (one connection, one lock); every write is its own short transaction."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self._outdated = False
        fresh = not self.path.exists()
        try:
            self._db = self._open()
            self._db.execute("SELECT count(*) FROM items").fetchone()
        except sqlite3.DatabaseError as e:
            # An unreadable catalogue is rebuilt from the disk tier rather than trusted or fatal.
            log.warning("catalogue %s unreadable (%s); rebuilding from disk", self.path, e)
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            fresh = True
            self._db = self._open()
        self.fresh = fresh or self._outdated  # the store rebuilds a fresh catalogue from the disk tier
        with self._lock, self._db:
            self._db.execute("UPDATE items SET dram = 0, gpu = 0 WHERE dram != 0 OR gpu != 0")

    def _open(self) -> sqlite3.Connection:
        # 0600 before SQLite opens it: SQLite gives the WAL and SHM files the database file's mode.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        db = sqlite3.connect(self.path, check_same_thread=False, timeout=30, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        have = {r[1] for r in db.execute("PRAGMA table_info(items)")}
        for column, ddl in (("context", "context TEXT NOT NULL DEFAULT ''"),
                            ("generation", "generation INTEGER NOT NULL DEFAULT 0"),
                            ("row_mac", "row_mac TEXT NOT NULL DEFAULT ''"),
                            ("memory", "memory BLOB")):
            if column not in have:
                # A catalogue from before the column: add it, then rebuild so every row gets its value.
                db.execute(f"ALTER TABLE items ADD COLUMN {ddl}")
                self._outdated = True
        for suffix in ("", "-wal", "-shm"):  # files of an older release, or made under another umask
            if os.path.exists(f"{self.path}{suffix}"):
                os.chmod(f"{self.path}{suffix}", 0o600)
        return db

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writes ---------------------------------------------------------------------------------------------
    def upsert(self, info: ItemInfo, embedding: bytes | None, memory: bytes | None = None) -> None:
        """Insert or replace an item (a re-put clears its corrupt flag and keeps its pin and its place: ``created``
        orders a user's memories, which is the order they are encoded behind each other). ``memory``: the item's
        memory record as stored (inferscale/store/memrecord.py; sealed in a sealed store)."""
        emb = embedding
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO items (tenant, user, fingerprint, item, path, size, kv_bytes, tokens, sha256, dram, gpu,"
                " last_access, pinned, corrupt, embedding, created, context, generation, row_mac, memory)"
                " VALUES (?,?,?,?,?,?,?,?,?,0,0,?,0,0,?,?,?,?,?,?)"
                " ON CONFLICT (tenant, user, fingerprint, item) DO UPDATE SET path=excluded.path, size=excluded.size,"
                " kv_bytes=excluded.kv_bytes, tokens=excluded.tokens, sha256=excluded.sha256, dram=0, gpu=0,"
                " corrupt=0, embedding=excluded.embedding, context=excluded.context,"
                " generation=excluded.generation, row_mac=excluded.row_mac, memory=excluded.memory",
                (*info.key, info.path, info.size, info.kv_bytes, info.tokens, info.sha256, info.last_access, emb,
                 info.created, CONTEXT_SEP.join(info.context), info.generation, info.row_mac, memory),
            )

    def reseal(self, rows: list[tuple[tuple[str, str, str, str], str, bytes | None, bytes | None]]) -> None:
        """Replace the row MAC, (sealed) embedding and (sealed) memory record of each (key, row_mac, embedding,
        memory): a key rotation."""
        with self._lock, self._db:
            self._db.executemany(
                "UPDATE items SET row_mac=?, embedding=?, memory=? WHERE tenant=? AND user=? AND fingerprint=?"
                " AND item=?", [(mac, emb, mem, *key) for key, mac, emb, mem in rows])

    def sealed_fields(self) -> list[tuple[tuple[str, str, str, str], int, bytes | None, bytes | None]]:
        """(key, generation, embedding, memory record) of every row: what a key rotation re-seals."""
        return [(tuple(r[:4]), r[4], r[5], r[6]) for r in self._query(
            "SELECT tenant, user, fingerprint, item, generation, embedding, memory FROM items")]

    def memories(self, tenant: str, user: str, fingerprint: str, item_ids: list[str]
                 ) -> list[tuple[str, bytes, int]]:
        """(item, memory record as stored, generation) of those of ``item_ids`` that have one and are not corrupt."""
        if not item_ids:
            return []
        return self._query(
            "SELECT item, memory, generation FROM items WHERE tenant=? AND user=? AND fingerprint=? AND memory IS NOT"
            f" NULL AND corrupt=0 AND item IN ({','.join('?' * len(item_ids))})",
            (tenant, user, fingerprint, *item_ids))

    def set_order(self, tenant: str, user: str, fingerprint: str, item_ids: list[str], start: float) -> None:
        """Make ``item_ids`` the user's list order from ``start`` on (``created`` = start, start + 1 us, ...)."""
        with self._lock, self._db:
            self._db.executemany(
                "UPDATE items SET created=? WHERE tenant=? AND user=? AND fingerprint=? AND item=?",
                [(start + n * 1e-6, tenant, user, fingerprint, i) for n, i in enumerate(item_ids)])

    def delete(self, keys: list[tuple[str, str, str, str]]) -> None:
        with self._lock, self._db:
            self._db.executemany("DELETE FROM items WHERE tenant=? AND user=? AND fingerprint=? AND item=?", keys)

    def set_flag(self, keys: list[tuple[str, str, str, str]], column: str, value: int) -> None:
        assert column in ("pinned", "corrupt")
        if not keys:
            return
        with self._lock, self._db:
            self._db.executemany(
                f"UPDATE items SET {column}=? WHERE tenant=? AND user=? AND fingerprint=? AND item=?",
                [(value, *k) for k in keys],
            )

    # -- reads ----------------------------------------------------------------------------------------------
    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def items(self, tenant: str, user: str | None = None, fingerprint: str | None = None,
              item_ids: list[str] | None = None) -> list[ItemInfo]:
        sql, args = f"SELECT {COLS} FROM items WHERE tenant=?", [tenant]
        if user is not None:
            sql += " AND user=?"
            args.append(user)
        if fingerprint is not None:
            sql += " AND fingerprint=?"
            args.append(fingerprint)
        if item_ids is not None:
            if not item_ids:
                return []
            sql += f" AND item IN ({','.join('?' * len(item_ids))})"
            args.extend(item_ids)
        return [_info(r) for r in self._query(sql + " ORDER BY user, item, fingerprint", tuple(args))]

    def all_items(self) -> list[ItemInfo]:
        return [_info(r) for r in self._query(f"SELECT {COLS} FROM items")]

    def users(self, tenant: str) -> list[str]:
        return [r[0] for r in self._query("SELECT DISTINCT user FROM items WHERE tenant=? ORDER BY user", (tenant,))]

    def embeddings(self, tenant: str, user: str, fingerprint: str) -> list[tuple[str, bytes, int]]:
        """(item, embedding, generation) of the user's items that have one."""
        return self._query(
            "SELECT item, embedding, generation FROM items WHERE tenant=? AND user=? AND fingerprint=? AND embedding IS NOT NULL"
            " AND corrupt=0 ORDER BY item", (tenant, user, fingerprint))

    def pinned_keys(self) -> set[tuple[str, str, str, str]]:
        return {tuple(r) for r in self._query("SELECT tenant, user, fingerprint, item FROM items WHERE pinned=1")}

    def totals(self) -> dict[str, int]:
        n, size, users, tenants, corrupt = self._query(
            "SELECT count(*), coalesce(sum(size),0), count(DISTINCT tenant || '/' || user), count(DISTINCT tenant),"
            " coalesce(sum(corrupt),0) FROM items")[0]
        return {"items": n, "disk_bytes": size, "users": users, "tenants": tenants, "corrupt": corrupt}

    def usage(self, tenant: str) -> tuple[int, int]:
        """(items, bytes on disk) of one tenant: what its memory and disk budgets bound."""
        n, size = self._query("SELECT count(*), coalesce(sum(size),0) FROM items WHERE tenant=?", (tenant,))[0]
        return int(n), int(size)

    def user_tokens(self, tenant: str, user: str, fingerprint: str) -> tuple[int, int]:
        """(items, their tokens) of one user's usable memories for one model."""
        n, tokens = self._query("SELECT count(*), coalesce(sum(tokens),0) FROM items WHERE tenant=? AND user=? AND"
                                " fingerprint=? AND corrupt=0", (tenant, user, fingerprint))[0]
        return int(n), int(tokens)

    def max_size(self) -> int:
        return self._query("SELECT coalesce(max(size), 0) FROM items")[0][0]
