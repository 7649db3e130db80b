"""Log records carry the current trace and span ids (``otelTraceID``/``otelSpanID``, "0" outside a span), and the
server logs, access log included (``server/accesslog.py``), at INFO by default with those ids in every line."""

from __future__ import annotations

import copy
import logging
from typing import Any

from opentelemetry.instrumentation.logging import LoggingInstrumentor

TRACE_FIELDS = "trace_id=%(otelTraceID)s span_id=%(otelSpanID)s"


def inject_trace_ids_into_logs() -> None:
    """Install OpenTelemetry's log record factory once per process (a second call is a no-op). It only adds the ids:
    no log format or handler of the process is changed, no log export is set up."""
    instrumentor = LoggingInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(inject_trace_context=True, enable_log_auto_instrumentation=False)


class TraceIdDefaults(logging.Filter):
    """Gives a record made before the record factory was installed (or by a foreign factory) the "0" ids, so the
    format below never fails on it."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name in ("otelTraceID", "otelSpanID"):
            if not hasattr(record, name):
                setattr(record, name, "0")
        return True


def uvicorn_log_config(level: str = "info") -> dict[str, Any]:
    """uvicorn's own logging config with the trace ids appended to each line, at ``level`` (access log included)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = f"{formatter['fmt']} {TRACE_FIELDS}"
    config.setdefault("filters", {})["trace_ids"] = {"()": TraceIdDefaults}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("trace_ids")
    for logger in config["loggers"].values():
        logger["level"] = level.upper()
    # Our own modules log through the same handler and format; the access log (route templates, never the raw
    # path: server/accesslog.py) through uvicorn's access handler, whose own access log is off.
    config["loggers"]["inferscale"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    config["loggers"]["inferscale.access"] = {"handlers": ["access"], "level": level.upper(), "propagate": False}
    return config
