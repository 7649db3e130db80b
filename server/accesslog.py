"""The access log: one line per request naming the route template (``PUT /v1/memories/{user}``), never the path the
caller sent (``<no route>`` for a path no route takes). A user string is often an e-mail address (``/v1/memories/alice%40example.com``); the store keeps it
only as an opaque id, and so does the log. uvicorn's own access log (which prints the raw path and query) is off
(``access_log=False``); these lines go to the ``inferscale.access`` logger in uvicorn's access format."""

from __future__ import annotations

import logging
import re
from typing import Any

from inferscale.server.openapi import documented_paths

log = logging.getLogger("inferscale.access")
UNMATCHED = "<no route>"  # a path no route matches: what was sent is not logged either


class RouteAccessLog:
    """Pure ASGI middleware: logs (client, method, route template, HTTP version, status) when the response starts,
    or a 500 when the app raised before it did."""

    def __init__(self, app) -> None:
        self.app = app
        self._templates: list[tuple[re.Pattern, str]] | None = None  # the app's OpenAPI paths, compiled once

    def route_template(self, scope: dict[str, Any]) -> str:
        """The template of the route that took the request (the router's choice), else of the first documented
        path that matches it (a request the guard refused before routing)."""
        path = getattr(scope.get("route"), "path", None)
        if path:
            return path
        if self._templates is None:
            self._templates = [(regex, p) for regex, p, _ in documented_paths(scope.get("app"))]
        return next((p for regex, p in self._templates if regex.match(scope.get("path", ""))), UNMATCHED)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            return await self.app(scope, receive, send)
        logged = False

        async def send_and_log(message):
            nonlocal logged
            if message["type"] == "http.response.start" and not logged:
                logged = True
                self._line(scope, self.route_template(scope), message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_log)
        except BaseException:
            if not logged:
                self._line(scope, self.route_template(scope), 500)
            raise

    @staticmethod
    def _line(scope, template: str, status: int) -> None:
        client = scope.get("client")
        addr = f"{client[0]}:{client[1]}" if client else "-"
        log.info('%s - "%s %s HTTP/%s" %d', addr, scope.get("method", "-"), template,
                 scope.get("http_version", "1.1"), status)
