"""OpenTelemetry for the server: one TracerProvider and one MeterProvider per app, the meter read both by OTLP and
by the Prometheus reader behind ``/metrics`` (one metrics stack, not two).

OTLP export (HTTP) is configured by the standard variables: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the
``..._TRACES_``/``..._METRICS_`` variants), ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_TRACES_EXPORTER``/``OTEL_METRICS_EXPORTER`` (``none`` turns one off) and
``OTEL_SDK_DISABLED``. ``--console-traces`` (INFERSCALE_CONSOLE_TRACES) also prints spans to stdout. Providers
are per app (never global), so several apps -- tests -- can live in one process. HTTP server spans, W3C
``traceparent`` extraction and the ``http.server.*`` metrics come from ``opentelemetry-instrumentation-fastapi``
(``instrument``), which labels by route template only, after routing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI
from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter
from prometheus_client import CollectorRegistry

from inferscale.engine.steptally import StepKey, StepTotals
from inferscale.server.genai_metrics import ServerMetrics

log = logging.getLogger(__name__)

# Paths that get no HTTP span: probes and scrapes would drown the traces (the instrumentation takes regexes).
UNTRACED_PATHS = "/healthz$,/readyz$,/metrics$"
SEMCONV_OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"


@dataclass
class Telemetry:
    tracer: trace.Tracer
    meter: metrics.Meter
    metrics: ServerMetrics
    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None
    # What /metrics serves: the Prometheus reader of this app's MeterProvider (empty when the SDK is disabled).
    prometheus: CollectorRegistry = field(default_factory=CollectorRegistry)

    def instrument(self, app: FastAPI) -> None:
        """HTTP server spans (parents of the chat span; the caller's ``traceparent`` is their parent) and metrics."""
        if self.tracer_provider is None:
            return
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(app, tracer_provider=self.tracer_provider,
                                           meter_provider=self.meter_provider, excluded_urls=UNTRACED_PATHS,
                                           exclude_spans=["receive", "send"])

    def shutdown(self) -> None:
        for p in (self.tracer_provider, self.meter_provider):
            if p is not None:
                try:
                    p.shutdown()
                except Exception:  # noqa: BLE001 - exporters may be unreachable at exit
                    pass


def _stable_http_semconv() -> None:
    """Opt in to the stable HTTP conventions before any instrumentation reads the setting (once per process): their
    metric attributes are method (unknown ones become ``_OTHER``), status, route template and scheme; the old ones
    also take the caller's ``Host`` header (``http.host``, ``http.server.name``), a label any caller could mint."""
    values = [v.strip() for v in os.environ.get(SEMCONV_OPT_IN, "").split(",") if v.strip()]
    values = [v for v in values if v != "http/dup"] + ([] if "http" in values else ["http"])
    os.environ[SEMCONV_OPT_IN] = ",".join(values)


def _enabled(var: str) -> bool:
    return os.environ.get(var, "otlp").strip().lower() not in ("none", "")


def _otlp_configured(signal: str) -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))


def _headers_from_file() -> None:
    """INFERSCALE_OTEL_HEADERS_FILE (a mounted Secret, e.g. the collector's auth) → OTEL_EXPORTER_OTLP_HEADERS, which
    the exporters read: the chart never puts a secret in an environment variable (checkov CKV_K8S_35)."""
    path = os.environ.get("INFERSCALE_OTEL_HEADERS_FILE")
    if path and not os.environ.get("OTEL_EXPORTER_OTLP_HEADERS"):
        from inferscale.secretfile import read_secret

        os.environ["OTEL_EXPORTER_OTLP_HEADERS"] = read_secret(path, "INFERSCALE_OTEL_HEADERS_FILE")


def setup(*, console: bool = False, span_exporter: SpanExporter | None = None,
          metric_reader: MetricReader | None = None,
          load: Callable[[], tuple[int, int]] = lambda: (0, 0),
          steps: Callable[[], Mapping[StepKey, StepTotals]] = dict,
          kv_usage: Callable[[], float | None] = lambda: None) -> Telemetry:
    """``load`` returns (running, waiting) sequences for the gauges, ``steps`` the serving loop's steps for their
    counters and ``kv_usage`` the share of the K/V budget held, read at collection time."""
    _stable_http_semconv()  # before any instrumentor (the logging one too) fixes the process-wide choice
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" and span_exporter is None:
        tracer = trace.NoOpTracerProvider().get_tracer(__name__)
        meter = metrics.NoOpMeterProvider().get_meter(__name__)
        return Telemetry(tracer, meter, ServerMetrics(meter, load, steps, kv_usage), None, None)

    _headers_from_file()
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "inferscale-server")}).merge(
        OTELResourceDetector().detect()
    )
    tp = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER[_ARG]
    if span_exporter is not None:
        tp.add_span_processor(SimpleSpanProcessor(span_exporter))
    if console:
        tp.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    if _enabled("OTEL_TRACES_EXPORTER") and _otlp_configured("TRACES"):
        _warn_protocol()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))

    # A registry of this app's own: the reader's default is prometheus_client's process-global one.
    registry = CollectorRegistry()
    readers: list[MetricReader] = [PrometheusMetricReader(registry=registry)]
    if metric_reader is not None:
        readers.append(metric_reader)
    if _enabled("OTEL_METRICS_EXPORTER") and _otlp_configured("METRICS"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    mp = MeterProvider(resource=resource, metric_readers=readers)
    tracer = tp.get_tracer("inferscale.server")
    meter = mp.get_meter("inferscale.server")
    return Telemetry(tracer, meter, ServerMetrics(meter, load, steps, kv_usage), tp, mp, registry)


def _warn_protocol() -> None:
    proto = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    if proto and not proto.startswith("http"):
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: only OTLP over HTTP is installed; exporting http/protobuf", proto)
