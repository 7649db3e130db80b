"""A Job's upload credential: what lets one encode Job deliver its sealed blobs to a serving pod, and nothing else.

The operator mints one per Job (operator/jobs.py puts it in the Job's own Secret); the serving pod's ingest route
(``POST /internal/v1/ingest/{tenant}/{user}``, server/ingest.py) verifies it. It is an HMAC-SHA256 over
(tenant, user, job, expiry) under a key derived from the internal token with its own label (HKDF-SHA256, info
``UPLOAD_LABEL``), so:
- it names one tenant and one user: presented for any other it is refused (``UploadDenied``, 403);
- it expires (the Job's deadline and a margin): after that, and when forged or malformed, ``UploadRefused`` (401);
- it is not the internal token and opens no other internal route; the token cannot be computed back from it.

Format: ``isu1.<base64url JSON claims>.<base64url MAC>``. Standard library and ``cryptography`` only (no torch).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from inferscale.errors import UploadDenied, UploadRefused

PREFIX = "isu1"
UPLOAD_LABEL = b"inferscale job upload credential v1"
MAX_TOKEN_CHARS = 2048


@dataclass(frozen=True)
class UploadClaims:
    tenant: str
    user: str
    job: str
    expires: int  # unix seconds


def upload_key(internal_token: str) -> bytes:
    """The MAC key of upload credentials, derived from the internal token under its own label."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=UPLOAD_LABEL).derive(internal_token.encode())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: bytes, body: str) -> bytes:
    return hmac.new(key, f"{PREFIX}.{body}".encode(), hashlib.sha256).digest()


def mint(key: bytes, tenant: str, user: str, job: str, ttl_s: int, *, now: float | None = None) -> str:
    """A credential for `job` to upload `tenant`/`user`'s blobs for the next `ttl_s` seconds."""
    claims = {"t": tenant, "u": user, "j": job, "exp": int((time.time() if now is None else now) + ttl_s)}
    body = _b64(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode())
    return f"{PREFIX}.{body}.{_b64(_mac(key, body))}"


def _claims(key: bytes, token: str) -> UploadClaims:
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise UploadRefused("upload credential missing or too long")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != PREFIX:
        raise UploadRefused("not an upload credential")
    try:
        mac = _unb64(parts[2])
    except (binascii.Error, ValueError):
        raise UploadRefused("upload credential malformed") from None
    if not hmac.compare_digest(mac, _mac(key, parts[1])):
        raise UploadRefused("upload credential does not verify (forged or for another platform)")
    raw = json.loads(_unb64(parts[1]))  # MACed by us: well-formed unless the key leaked
    return UploadClaims(str(raw["t"]), str(raw["u"]), str(raw["j"]), int(raw["exp"]))


def verify(key: bytes, token: str | None, tenant: str, user: str, *, now: float | None = None) -> UploadClaims:
    """The claims of `token` when it lets its holder upload `tenant`/`user`'s blobs now; UploadRefused when it is
    forged, malformed or expired, UploadDenied when it names another tenant or user."""
    claims = _claims(key, token or "")
    if claims.expires < (time.time() if now is None else now):
        raise UploadRefused(f"upload credential of Job {claims.job!r} expired")
    if (claims.tenant, claims.user) != (tenant, user):
        raise UploadDenied(f"the upload credential of Job {claims.job!r} is not for tenant {tenant!r} user {user!r}")
    return claims
