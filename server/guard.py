"""Limits before work, in front of every route (pure ASGI, no framework in between).

``TenantGuard`` runs before FastAPI sees a request, so nothing below it allocates for a caller it has not
admitted:
1. ``Content-Length`` over the limit -> 413 before a byte of the body is read;
2. on ``/v1/*`` the API key is checked from the headers alone -> 401 before a byte of the body is read (a key
   cannot come in the body, so an unauthenticated flood costs one header parse);
3. the tenant's in-flight slot for EVERY ``/v1/*`` route (chat and memories alike) -> 429 + ``Retry-After``; the
   slot is given back as the response's last bytes are handed on, before the client can read them and send its
   next request (a streamed answer gives it back before its ``[DONE]``: ``Admission``);
4. the body is read from the ASGI receive stream, counting bytes, chunked uploads included -> 413 as soon as
   the running total crosses the limit (never buffering past it), and replayed to the app;
5. the ``x-inferscale-ttft-ms`` response header is rounded up to ``TTFT_GRANULARITY_MS``, so the header is not a
   finer instrument than a tenant's own clock for observing other tenants' load (docs/interfaces.md).
The internal listener gets 1 and 4, and its token (INFERSCALE_INTERNAL_TOKEN) checked the same way before the body
(its routes check it again; tenant keys mean nothing there). Its one exception is a Job's delivery
(``INGEST_PREFIX``): a per-Job upload credential for the path's tenant and user (inferscale/uploadtoken.py) is
checked from the headers before the body, ``Content-Length`` against the larger ``upload_limit``, and the body is
streamed to the route, which counts it against the same limit (server/ingest.py).
"""

from __future__ import annotations

import hmac
import math
from typing import Any, Awaitable, Callable

from inferscale.contract import TTFT_GRANULARITY_MS
from inferscale.errors import UploadDenied, UploadRefused
from inferscale.server.auth import AuthError, Tenant, TenantRegistry
from inferscale.server.httperrors import response as error_response

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
TTFT_HEADER = b"x-inferscale-ttft-ms"
RETRY_AFTER_S = 1  # an in-flight slot frees when one of the tenant's own requests ends
INGEST_PREFIX = "/internal/v1/ingest/"
# (tenant, user, bearer) -> None when that credential may upload there; raises UploadRefused / UploadDenied.
UploadCheck = Callable[[str, str, str | None], None]


ADMISSION = "admission"  # the request state's key of its ``Admission``


class Admission:
    """One request's place in its tenant's in-flight count, given back once. After the response was sent was too
    late: a client with one request in flight that sent its next as soon as it had read the last one was refused
    429 now and then (a CI run's ``test_in_flight_limit_is_429``)."""

    def __init__(self, tenant: Tenant) -> None:
        self._tenant: Tenant | None = tenant

    def leave(self) -> None:
        tenant, self._tenant = self._tenant, None
        if tenant is not None:
            tenant.leave()


def coarse_ttft_ms(value: float) -> float:
    """A TTFT in ms rounded up to the granularity the tenant API reports (never 0 for a positive TTFT)."""
    return float(math.ceil(max(0.0, value) / TTFT_GRANULARITY_MS) * TTFT_GRANULARITY_MS)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", []):
        if k == name:
            return v
    return None


def bearer_token(scope: Scope) -> str | None:
    scheme, _, token = (_header(scope, b"authorization") or b"").decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class TenantGuard:
    """See the module docstring. ``tenants`` None = no tenant checks (the internal listener)."""

    def __init__(self, app, *, limit: int, tenants: TenantRegistry | None = None, coarse_ttft: bool = True,
                 internal_token: str | None = None, upload_check: UploadCheck | None = None,
                 upload_limit: int = 0) -> None:
        self.app, self.limit, self.tenants, self.coarse_ttft = app, limit, tenants, coarse_ttft
        self.internal_token = internal_token
        self.upload_check, self.upload_limit = upload_check, upload_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.upload_check is not None and scope.get("path", "").startswith(INGEST_PREFIX):
            return await self._upload(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        if self.internal_token and scope.get("path", "").startswith("/internal/"):
            got = bearer_token(scope) or ""
            if not hmac.compare_digest(got.encode(), self.internal_token.encode()):
                resp = error_response(401, "incorrect internal token", "authentication_error", "invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
                return await resp(scope, receive, send)
        tenant = admission = None
        if self.tenants is not None and scope.get("path", "").startswith("/v1/"):
            try:
                tenant = self.tenants.authenticate(bearer_token(scope))
            except AuthError as e:
                resp = error_response(e.status, str(e), "authentication_error", e.code,
                                      headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
                return await resp(scope, receive, send)
            if not tenant.admit():
                resp = error_response(429, f"too many requests in flight for this tenant (limit "
                                      f"{tenant.max_in_flight})", "rate_limit_error", "rate_limit_exceeded",
                                      headers={"Retry-After": str(RETRY_AFTER_S)})
                return await resp(scope, receive, send)
            admission = Admission(tenant)
            scope.setdefault("state", {}).update({"tenant": tenant, ADMISSION: admission})
        try:
            body = await self._read_body(receive)
            if body is None:
                return await self._too_large(scope, receive, send)
            await self.app(scope, self._replay(body, receive), self._filter(send, admission))
        finally:
            if admission is not None:
                admission.leave()

    async def _upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A Job's delivery: its own credential and size limit, checked before the body; the body streamed."""
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.upload_limit:
            resp = error_response(413, f"delivery over {self.upload_limit} bytes", "invalid_request_error",
                                  "request_too_large", headers={"Connection": "close"})
            return await resp(scope, receive, send)
        parts = scope["path"][len(INGEST_PREFIX):].split("/")
        try:
            if len(parts) != 2:
                raise UploadDenied("a delivery path is /internal/v1/ingest/{tenant}/{user}")
            assert self.upload_check is not None
            self.upload_check(parts[0], parts[1], bearer_token(scope))
        except (UploadRefused, UploadDenied) as e:
            status, code = (401, "invalid_upload_credential") if isinstance(e, UploadRefused) else \
                (403, "upload_not_permitted")
            resp = error_response(status, str(e), "authentication_error" if status == 401 else "permission_error",
                                  code, headers={"Connection": "close"})
            return await resp(scope, receive, send)
        await self.app(scope, receive, send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it is over the limit (the rest is never read)."""
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > self.limit:
                return None
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        return b"".join(chunks)

    @staticmethod
    def _replay(body: bytes, receive: Receive) -> Receive:
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        return replay

    def _filter(self, send: Send, admission: Admission | None = None) -> Send:
        if not self.coarse_ttft and admission is None:
            return send

        async def filtered(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.body" and not msg.get("more_body", False) and admission is not None:
                admission.leave()  # before the client can have the end and send its next request
            if msg["type"] == "http.response.start" and self.coarse_ttft:
                headers = []
                for k, v in msg.get("headers", []):
                    if k.lower() == TTFT_HEADER:
                        try:
                            v = f"{coarse_ttft_ms(float(v)):.0f}".encode()
                        except ValueError:
                            continue
                    headers.append((k, v))
                msg = {**msg, "headers": headers}
            await send(msg)

        return filtered

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = error_response(413, f"request body over {self.limit} bytes", "invalid_request_error",
                              "request_too_large", headers={"Connection": "close"})
        await resp(scope, receive, send)
