"""The probes and the scrape on the tenant port: ``/healthz`` (liveness: the engine worker runs), ``/readyz``
(readiness) and ``/metrics``. Anyone on the network reaches this port, so the probes say only ok / not ok, and
``/metrics`` (every tenant's activity: requests running and queued, memories encoded, bytes fetched per tier)
answers only to the Bearer ``INFERSCALE_METRICS_TOKEN``; with none set it is not served at all."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inferscale.server.guard import bearer_token
from inferscale.server.httperrors import ApiError, response as error_response

router = APIRouter(tags=["ops"])


def _worker_down() -> Response:
    return error_response(503, "not ready", "server_error", "unavailable")


@router.get("/healthz")
async def healthz(request: Request):
    """Liveness: false once the engine worker has stopped (the replica must be restarted)."""
    return {"status": "ok"} if request.app.state.worker.alive else _worker_down()


@router.get("/readyz")
async def readyz(request: Request):
    """Readiness: no load figures (they would show other tenants' activity to anyone)."""
    return {"status": "ready"} if request.app.state.worker.alive else _worker_down()


@router.get("/metrics", response_class=Response, include_in_schema=False)
async def prometheus_metrics(request: Request):
    st = request.app.state
    token = st.settings.metrics_token
    if not token:
        raise ApiError(404, "Not Found: set INFERSCALE_METRICS_TOKEN to serve /metrics", type="not_found_error")
    if not hmac.compare_digest((bearer_token(request.scope) or "").encode(), token.encode()):
        raise ApiError(401, "/metrics needs the metrics token (Authorization: Bearer)", type="authentication_error",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return Response(generate_latest(st.telemetry.prometheus), media_type=CONTENT_TYPE_LATEST)
