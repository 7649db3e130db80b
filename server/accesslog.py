"""The access log: one line per request naming the route template (``PUT /v1/memories/{user}``), never the path the
caller sent. A user string is often an e-mail address (``/v1/memories/alice%40example.com``); the store keeps it
only as an opaque id, and so does the log. uvicorn's own access log (which prints the raw path and query) is off
(``access_log=False``); these lines go to the ``inferscale.access`` logger in uvicorn's access format."""

from __future__ import annotations

import logging
from typing import Any

from starlette.routing import Match

log = logging.getLogger("inferscale.access")
UNMATCHED = "<no route>"  # a path no route matches: what was sent is not logged either


def route_template(scope: dict[str, Any]) -> str:
    """The template of the route that took (or would take) the request: the router's choice when it ran, else the
    first full match among the app's routes (a request the guard refused before routing)."""
    route = scope.get("route")
    if route is None:
        for candidate in getattr(scope.get("app"), "routes", ()):
            if candidate.matches(scope)[0] is Match.FULL:
                route = candidate
                break
    return getattr(route, "path", None) or UNMATCHED


class RouteAccessLog:
    """Pure ASGI middleware: logs (client, method, route template, HTTP version, status) when the response starts,
    or a 500 when the app raised before it did."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            return await self.app(scope, receive, send)
        logged = False

        async def send_and_log(message):
            nonlocal logged
            if message["type"] == "http.response.start" and not logged:
                logged = True
                self._line(scope, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_log)
        except BaseException:
            if not logged:
                self._line(scope, 500)
            raise

    @staticmethod
    def _line(scope, status: int) -> None:
        client = scope.get("client")
        addr = f"{client[0]}:{client[1]}" if client else "-"
        log.info('%s - "%s %s HTTP/%s" %d', addr, scope.get("method", "-"), route_template(scope),
                 scope.get("http_version", "1.1"), status)
