"""Tenants and API keys. The key alone decides the tenant.

Tenants file (a local file or a mounted Kubernetes Secret), JSON, hashed keys only:
    {"acme": ["<sha256 hex of key>", ...],
     "globex": {"keys": ["<sha256>"], "max_k": 20, "max_tokens": 256, "max_in_flight": 8,
                "max_memories": 10000, "max_disk_bytes": 10737418240, "dram_bytes": 1073741824,
                "encode_tokens_per_minute": 200000}}
Limits left out come from the server settings (``dram_bytes`` null: no share below the whole DRAM budget).
The file is re-read when it changes (Secret rotation).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from inferscale.errors import ConfigError

TENANT_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a Kubernetes namespace name
KEY_PREFIX = "isk-"


class AuthError(Exception):
    def __init__(self, message: str, status: int = 401, code: str = "invalid_api_key") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass
class Tenant:
    name: str
    max_k: int
    max_tokens: int
    max_in_flight: int
    max_memories: int = 1 << 30  # items stored on this pod, every user and model
    max_disk_bytes: int = 1 << 62  # blob bytes on this pod's disk
    dram_bytes: int | None = None  # DRAM share (KVStore tenant quota); None = the store's default
    encode_tokens_per_minute: int = 1 << 30  # memory tokens encoded, token bucket refilled continuously
    encode_budget: float = -1.0  # tokens left in the bucket (-1: full, set on first use)
    encode_stamp: float = 0.0
    in_flight: int = 0  # chat requests in the engine (server/chat.py)
    requests: int = 0  # requests in flight on every /v1 route (server/guard.py), same limit
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def acquire(self) -> bool:
        with self._lock:
            if self.in_flight >= self.max_in_flight:
                return False
            self.in_flight += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.in_flight = max(0, self.in_flight - 1)

    def take_encode_tokens(self, n: int) -> float:
        """Spend ``n`` encode tokens: 0.0 when taken, else the seconds until the bucket holds ``n`` (nothing spent).
        A request larger than a whole minute's budget is the caller's to refuse as too large."""
        with self._lock:
            now, rate = time.monotonic(), self.encode_tokens_per_minute / 60.0
            if self.encode_budget < 0:
                self.encode_budget, self.encode_stamp = float(self.encode_tokens_per_minute), now
            self.encode_budget = min(float(self.encode_tokens_per_minute),
                                     self.encode_budget + (now - self.encode_stamp) * rate)
            self.encode_stamp = now
            if n <= self.encode_budget:
                self.encode_budget -= n
                return 0.0
            return (n - self.encode_budget) / rate if rate > 0 else float("inf")

    def admit(self) -> bool:
        """A slot for one request on any /v1 route (its own counter, so chat's engine slot nests inside it)."""
        with self._lock:
            if self.requests >= self.max_in_flight:
                return False
            self.requests += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.requests = max(0, self.requests - 1)


def create_tenants_file(path: Path, tenant: str = "default") -> str:
    """Write a tenants file with one tenant and a fresh key; return the key (shown once, stored hashed)."""
    key = new_key()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({tenant: [hash_key(key)]}, f, indent=2)
        f.write("\n")
    return key


class TenantRegistry:
    def __init__(self, path: Path, *, max_k: int, max_tokens: int, max_in_flight: int,
                 budgets: dict[str, int | None] | None = None) -> None:
        """``budgets``: server defaults of the other per-tenant fields (max_memories, max_disk_bytes, dram_bytes,
        encode_tokens_per_minute)."""
        self.path = Path(path)
        self.defaults: dict[str, int | None] = dict(max_k=max_k, max_tokens=max_tokens, max_in_flight=max_in_flight,
                                                    **(budgets or {}))
        self._watchers: list = []
        self._by_hash: dict[str, Tenant] = {}
        self._tenants: dict[str, Tenant] = {}
        self._stamp: tuple | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        self._forbidden: dict[str, str] = {}  # sha256 of a plane credential -> the variable holding it
        self.reload()

    def forbid(self, credentials: dict[str, str]) -> None:
        """Refuse (ConfigError) any tenant key equal to one of ``credentials`` (variable -> value: the internal
        token, the peer secret), now and on every reload, so a tenant key can never act on another plane."""
        self._forbidden = {hash_key(v): name for name, v in credentials.items() if v}
        with self._lock:
            known = list(self._by_hash)
        self._check_forbidden(known)

    def _check_forbidden(self, hashes: list[str]) -> None:
        for h in hashes:
            for bad, name in self._forbidden.items():
                if hmac.compare_digest(h, bad):
                    raise ConfigError(f"tenants file {self.path}: a tenant API key equals {name}; "
                                      f"use different secrets for the tenant API and the {name} plane")

    def _file_stamp(self) -> tuple:
        st = self.path.stat()
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reload(self) -> None:
        try:
            stamp = self._file_stamp()
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"tenants file {self.path}: not found") from None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"tenants file {self.path}: unreadable ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"tenants file {self.path}: expected an object of tenant -> key hashes")
        by_hash: dict[str, Tenant] = {}
        tenants: dict[str, Tenant] = {}
        for name, entry in raw.items():
            if not TENANT_RE.match(name):
                raise ConfigError(f"tenants file {self.path}: tenant {name!r} is not a valid name (a DNS label)")
            spec = {"keys": entry} if isinstance(entry, list) else entry
            if not isinstance(spec, dict) or not isinstance(spec.get("keys"), list):
                raise ConfigError(f"tenants file {self.path}: tenant {name!r} needs a list of key hashes")
            limits = {k: _limit(self.path, name, k, spec.get(k, v)) for k, v in self.defaults.items()}
            old = self._tenants.get(name)
            t = Tenant(name=name, **limits)
            if old is not None:  # keep the in-flight counts and the encode bucket across reloads
                t.in_flight, t.requests = old.in_flight, old.requests
                t.encode_budget, t.encode_stamp = old.encode_budget, old.encode_stamp
                t._lock = old._lock
            tenants[name] = t
            for h in spec["keys"]:
                if not isinstance(h, str) or not re.fullmatch(r"[0-9a-f]{64}", h):
                    raise ConfigError(f"tenants file {self.path}: tenant {name!r} has a key that is not a sha256 hex")
                by_hash[h] = t
        self._check_forbidden(list(by_hash))
        with self._lock:
            self._by_hash, self._tenants, self._stamp = by_hash, tenants, stamp
        for watch in self._watchers:
            watch(list(tenants.values()))

    def watch(self, callback) -> None:
        """Call ``callback(tenants)`` now and after every reload (the store's per-tenant DRAM shares)."""
        self._watchers.append(callback)
        callback(list(self._tenants.values()))

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < 1.0:
            return
        self._checked = now
        try:
            if self._file_stamp() != self._stamp:
                self.reload()
        except (OSError, ConfigError):
            pass  # keep serving with the last good file

    def authenticate(self, key: str | None) -> Tenant:
        if not key:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        self._maybe_reload()
        h = hash_key(key)
        with self._lock:
            for known, tenant in self._by_hash.items():
                if hmac.compare_digest(known, h):
                    return tenant
        raise AuthError("incorrect API key")

    @property
    def names(self) -> list[str]:
        return sorted(self._tenants)


def _limit(path: Path, tenant: str, field_name: str, value: object) -> int | None:
    if value is None and field_name == "dram_bytes":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"tenants file {path}: tenant {tenant!r} field {field_name!r} must be a non-negative integer")
    return value


def bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def require_tenant(request: Request) -> Tenant:
    """FastAPI dependency: the caller's tenant, from its API key (already checked, before the body was read, by
    server/guard.py when the app runs behind it)."""
    admitted = getattr(request.state, "tenant", None)
    if admitted is not None:
        return admitted
    return request.app.state.tenants.authenticate(bearer(request))


def require_internal(request: Request) -> None:
    """FastAPI dependency for /internal/v1/* (served only on the internal listener): the operator's token,
    compared in constant time. Tenant keys are never looked at here."""
    expected = request.app.state.settings.internal_token
    if not expected:
        raise AuthError("internal API disabled: INFERSCALE_INTERNAL_TOKEN is not set", 401, "internal_disabled")
    got = bearer(request)
    if not got or not hmac.compare_digest(got.encode(), expected.encode()):
        raise AuthError("incorrect internal token")
