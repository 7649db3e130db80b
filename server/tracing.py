"""OpenTelemetry: traces and the GenAI TTFT metric, plus the Prometheus metrics behind /metrics.

OTLP export (HTTP) is configured by the standard variables: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the
``..._TRACES_``/``..._METRICS_`` variants), ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_TRACES_EXPORTER``/``OTEL_METRICS_EXPORTER`` (``none`` turns one off) and
``OTEL_SDK_DISABLED``. ``--console-traces`` (INFERSCALE_CONSOLE_TRACES) also prints spans to stdout. Providers
are per app (never global), so several apps -- tests -- can live in one process.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger(__name__)

TTFT_METRIC = "gen_ai.server.time_to_first_token"
# The GenAI semantic conventions' advised buckets for TTFT.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]


@dataclass
class Telemetry:
    tracer: trace.Tracer
    meter: metrics.Meter
    ttft: metrics.Histogram
    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None
    prom: Prom

    def shutdown(self) -> None:
        for p in (self.tracer_provider, self.meter_provider):
            if p is not None:
                try:
                    p.shutdown()
                except Exception:  # noqa: BLE001 - exporters may be unreachable at exit
                    pass


class Prom:
    """Prometheus metrics in a registry of their own (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("inferscale_http_requests", "HTTP requests", ["path", "status"], registry=r)
        self.ttft = Histogram("inferscale_ttft_seconds", "time to first token", ["mode"], buckets=TTFT_BUCKETS, registry=r)
        self.tokens = Counter("inferscale_generated_tokens", "completion tokens generated", ["mode"], registry=r)
        self.kv_bytes = Counter("inferscale_kv_fetch_bytes", "KV bytes fetched from the store", ["tier"], registry=r)
        self.active = Gauge("inferscale_active_sequences", "sequences being decoded", registry=r)
        self.queued = Gauge("inferscale_queued_jobs", "jobs waiting for the engine worker", registry=r)
        self.encoded = Counter("inferscale_memories_encoded", "memory items encoded", registry=r)
        self.rejected = Counter("inferscale_rejected_requests", "requests refused by a tenant limit", ["limit"], registry=r)


def _enabled(var: str) -> bool:
    return os.environ.get(var, "otlp").strip().lower() not in ("none", "")


def _otlp_configured(signal: str) -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))


def setup(*, console: bool = False, span_exporter: SpanExporter | None = None,
          metric_reader: MetricReader | None = None) -> Telemetry:
    prom = Prom()
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" and span_exporter is None:
        tracer = trace.NoOpTracerProvider().get_tracer(__name__)
        meter = metrics.NoOpMeterProvider().get_meter(__name__)
        return Telemetry(tracer, meter, meter.create_histogram(TTFT_METRIC, unit="s"), None, None, prom)

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

    readers: list[MetricReader] = [metric_reader] if metric_reader is not None else []
    if _enabled("OTEL_METRICS_EXPORTER") and _otlp_configured("METRICS"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    view = View(instrument_name=TTFT_METRIC, aggregation=ExplicitBucketHistogramAggregation(TTFT_BUCKETS))
    mp = MeterProvider(resource=resource, metric_readers=readers, views=[view])
    tracer = tp.get_tracer("inferscale.server")
    meter = mp.get_meter("inferscale.server")
    ttft = meter.create_histogram(TTFT_METRIC, unit="s", description="Time to generate the first token")
    return Telemetry(tracer, meter, ttft, tp, mp, prom)


def _warn_protocol() -> None:
    proto = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    if proto and not proto.startswith("http"):
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: only OTLP over HTTP is installed; exporting http/protobuf", proto)
