"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}`` for every failure, never a bare 500."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferscale import errors as E
from inferscale.server.auth import AuthError
from inferscale.server.openapi import documented_paths
from inferscale.server.schemas import ErrorBody

log = logging.getLogger(__name__)

# What the document says of errors: every 4xx and 5xx answer is an OpenAI-style ErrorBody (this module's handlers),
# a validation error a 400, never FastAPI's default 422 (which it adds only where no 4XX is declared).
ERROR_RESPONSES: dict[int | str, dict] = {
    "4XX": {"model": ErrorBody, "description": "the caller's error (400 bad input, 401 no or bad key, 404 no such "
            "model, user or item, 405, 409, 413 body too large, 429 over the tenant's share, with Retry-After)"},
    "5XX": {"model": ErrorBody, "description": "the server's error (500, 503 overloaded or not ready, with "
            "Retry-After where waiting helps)"},
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers


def body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def response(status: int, message: str, type: str, code: str | None = None, param: str | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body(message, type, code, param), status_code=status, headers=headers)


# Typed engine/store errors -> (status, type, code).
_TYPED: list[tuple[type[E.InferScaleError], int, str, str | None]] = [
    (E.UploadRefused, 401, "authentication_error", "invalid_upload_credential"),
    (E.UploadDenied, 403, "permission_error", "upload_not_permitted"),
    (E.NotFoundError, 404, "not_found_error", "not_found"),
    (E.PromptTooLongError, 400, "invalid_request_error", "context_length_exceeded"),
    (E.MemoryItemError, 400, "invalid_request_error", "invalid_memory_item"),
    (E.InvalidInputError, 400, "invalid_request_error", "invalid_value"),
    (E.ConfigError, 500, "server_error", "configuration_error"),  # the deployment's to fix, not the caller's
    (E.UnsafePathError, 400, "invalid_request_error", "unsafe_path"),
    (E.QuotaExceededError, 429, "insufficient_quota", "quota_exceeded"),  # in-use blocks hold it: Retry-After
    (E.FingerprintMismatchError, 409, "conflict_error", "fingerprint_mismatch"),
    (E.BlobCorruptError, 503, "server_error", "blob_corrupt"),
    (E.StorageError, 507, "server_error", "insufficient_storage"),  # the node's disk, not the request
    (E.TransferError, 424, "failed_dependency", "transfer_failed"),  # the named source could not provide it
    (E.InferScaleError, 400, "invalid_request_error", None),
]


def from_typed(e: E.InferScaleError) -> ApiError:
    if isinstance(e, E.EngineBusyError):  # queue full, queue timeout, or no engine: come back later
        busy = "engine_unavailable" if isinstance(e, E.EngineUnavailableError) else "engine_busy"
        return ApiError(503, str(e), type="server_error", code=busy, headers={"Retry-After": str(e.retry_after_s)})
    for cls, status, type_, code in _TYPED:
        if isinstance(e, cls):
            headers = {"Retry-After": "1"} if status == 429 else None  # every 429 says when to come back
            return ApiError(status, str(e), type=type_, code=code, param=getattr(e, "param", None), headers=headers)
    return ApiError(500, str(e), type="server_error")


def from_exception(e: BaseException) -> ApiError:
    """What a client is told of ``e``: a typed error's own status (400 when its input caused it), else a 500 that
    names only an error id; the traceback is logged under that id, never sent."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, E.InferScaleError):
        return from_typed(e)
    error_id = uuid.uuid4().hex[:16]
    log.error("internal error %s", error_id, exc_info=(type(e), e, e.__traceback__))
    return ApiError(500, f"internal error (id {error_id}); report this id to the operator", type="server_error",
                    code="internal_error")


# Pydantic names the member of a union it tried in an error's location ("list[constrained-str]", "str"): not a param.
_UNION_TAG = re.compile(r"[^\[\]]*\[.*\]|str|int|float|bool|constrained-str")


def _union_tag(part: object) -> bool:
    return isinstance(part, str) and _UNION_TAG.fullmatch(part) is not None


def _specific(errors: Sequence[dict]) -> list[dict]:
    """The errors that say what is wrong: a value that fails every member of a union is reported once per member,
    and a member of another type only says it is not that type ("stop": 1,000 strings fail ``str`` as not a string
    and ``list[str]`` as too long; the second is the caller's mistake)."""
    def other_type(e: dict) -> bool:
        return str(e.get("type", "")).endswith("_type") and any(map(_union_tag, e.get("loc", ())))
    return [e for e in errors if not other_type(e)] or list(errors)


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header") and not _union_tag(p)]
    return ".".join(parts) or None


# ---- x-request-id -------------------------------------------------------------------------------------------
REQUEST_ID_HEADER = "x-request-id"
_CALLER_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, bounded: safe in logs and headers


class RequestId:
    """Pure ASGI middleware: every response carries ``x-request-id``: the caller's when it is 1-128 printable ASCII
    characters, else a new one. Handlers read it with ``request_id(request)``."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", []) if k == REQUEST_ID_HEADER.encode()), b"")
        rid = given.decode("latin-1") if _CALLER_REQUEST_ID.fullmatch(given.decode("latin-1")) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER.encode()]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER.encode(), rid.encode())]}
            await send(message)

        return await self.app(scope, receive, send_with_id)


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or ""


def install(app: FastAPI) -> None:
    """Error handlers (OpenAI's error body) and the x-request-id middleware."""
    app.add_middleware(RequestId)

    @app.exception_handler(ApiError)
    async def _api(_: Request, e: ApiError):
        return response(e.status, e.message, e.type, e.code, e.param, e.headers)

    @app.exception_handler(AuthError)
    async def _auth(_: Request, e: AuthError):
        return response(e.status, str(e), "authentication_error" if e.status == 401 else "permission_error", e.code,
                        headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(E.InferScaleError)
    async def _typed(_: Request, e: E.InferScaleError):
        a = from_typed(e)
        return response(a.status, a.message, a.type, a.code, a.param, headers=a.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        errs = _specific(e.errors())
        first: dict = errs[0] if errs else {"msg": "invalid request", "loc": (), "type": "invalid"}
        if first.get("type") == "json_invalid":
            return response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}",
                            "invalid_request_error", "invalid_json")
        param = _param(tuple(first.get("loc", ())))
        if first.get("type") == "extra_forbidden":  # OpenAI's words for a field it does not know
            return response(400, f"Unrecognized request argument supplied: {param}", "invalid_request_error",
                            "unrecognized_argument", param)
        msg = f"{param}: {first['msg']}" if param else str(first["msg"])
        if len(errs) > 1:
            msg += f" (and {len(errs) - 1} more)"
        return response(400, msg, "invalid_request_error", "invalid_value", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        type_ = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        headers = getattr(e, "headers", None)
        if e.status_code == 405:
            headers = {**(headers or {}), "Allow": allowed_methods(request, (headers or {}).get("Allow", ""))}
        return response(e.status_code, str(e.detail), type_, None, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        a = from_exception(e)
        return response(a.status, a.message, a.type, a.code, a.param, a.headers)


def allowed_methods(request: Request, fallback: str) -> str:
    """Every method the document gives the request's path. Starlette's 405 names only the first route that matched
    the path (``Allow: PUT`` for /v1/memories/{user}, which also serves GET and DELETE: schemathesis' ST205); RFC 9110
    asks for all of them. ``fallback`` (Starlette's) for a path the document does not show."""
    path = request.scope.get("path", "")
    methods = {m for regex, _, ms in documented_paths(request.app) if regex.match(path) for m in ms}
    return ", ".join(sorted(methods)) or fallback
