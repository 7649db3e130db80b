"""The server's metric instruments and one chat request's span + GenAI metrics (``ChatTelemetry``).

Names follow the OpenTelemetry GenAI semantic conventions (``gen_ai.server.*``), with vLLM's familiar counters and
gauges beside them under ``inferscale.*`` (Prometheus: ``inferscale_prompt_tokens_total`` for vLLM's
``vllm:prompt_tokens_total``, ...): the README's metrics table maps one to the other. No metric takes a path or any
other value a caller chooses freely: model (one of the served ids), mode (one of MODES), tier, finish reason, limit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Callable, Sequence

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation

from inferscale.engine.steptally import StepKey, StepTotals, by_label

PROVIDER = "inferscale"  # gen_ai.provider.name: no well-known value fits a self-hosted engine
# The GenAI semantic conventions' advised bucket boundaries.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]


class ServerMetrics:
    """Every instrument of the server, on one meter. ``load`` returns (running, waiting), ``steps`` the serving
    loop's steps (``EngineBackend.step_totals``) and ``kv_usage`` the share of the K/V budget held
    (``EngineBackend.kv_usage``) at collection time."""

    def __init__(self, meter: metrics.Meter, load: Callable[[], tuple[int, int]],
                 steps: Callable[[], Mapping[StepKey, StepTotals]] = dict,
                 kv_usage: Callable[[], float | None] = lambda: None) -> None:
        self.load, self.steps, self.kv_usage = load, steps, kv_usage
        h = meter.create_histogram
        self.ttft = h("gen_ai.server.time_to_first_token", unit="s", description="Time to generate the first token",
                      explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.tpot = h("gen_ai.server.time_per_output_token", unit="s",
                      description="Time per output token after the first (inter-token latency)",
                      explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.duration = h("gen_ai.server.request.duration", unit="s",
                          description="Time from request to last token (end-to-end latency)",
                          explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        c = meter.create_counter
        self.prompt_tokens = c("inferscale.prompt_tokens", unit="{token}", description="Prompt tokens, memory included")
        self.memory_tokens = c("inferscale.memory_tokens", unit="{token}", description="Injected memory tokens")
        self.generation_tokens = c("inferscale.generation_tokens", unit="{token}", description="Generated tokens")
        self.request_success = c("inferscale.request_success", unit="{request}",
                                 description="Finished chat requests by finish reason")
        self.kv_fetch_bytes = c("inferscale.kv_fetch_bytes", unit="By", description="KV bytes fetched from the store")
        self.memories_encoded = c("inferscale.memories_encoded", unit="{item}", description="Memory items encoded")
        self.rejected_requests = c("inferscale.rejected_requests", unit="{request}",
                                   description="Requests refused by a tenant limit")
        meter.create_observable_gauge("inferscale.num_requests_running", [self._running], unit="{request}",
                                      description="Sequences being decoded")
        meter.create_observable_gauge("inferscale.num_requests_waiting", [self._waiting], unit="{request}",
                                      description="Jobs waiting for the engine worker")
        meter.create_observable_gauge("inferscale.kv_cache_usage", [self._kv_usage], unit="1",
                                      description="Share of the K/V budget the running requests hold")
        meter.create_observable_counter("inferscale.engine.steps", [self._step_counts], unit="{step}",
                                        description="Serving loop steps by rows decoded and kind")
        meter.create_observable_counter("inferscale.engine.step_time", [self._step_seconds], unit="s",
                                        description="Wall time of the serving loop's steps by rows decoded and kind")

    def _running(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self.load()[0])]

    def _waiting(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self.load()[1])]

    def _kv_usage(self, _options: CallbackOptions) -> list[Observation]:
        usage = self.kv_usage()
        return [] if usage is None else [Observation(usage)]

    def _step_counts(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(t.steps, _step_attrs(key)) for key, t in by_label(self.steps()).items()]

    def _step_seconds(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(t.seconds, _step_attrs(key)) for key, t in by_label(self.steps()).items()]

    def rejected(self, limit: str) -> None:
        self.rejected_requests.add(1, {"inferscale.limit": limit})

    def kv_fetched(self, tiers: str, nbytes: int) -> None:
        self.kv_fetch_bytes.add(nbytes, {"inferscale.kv.tier": tiers})

    def encoded(self, n: int) -> None:
        self.memories_encoded.add(n)


def _step_attrs(key: tuple[str, str]) -> dict[str, str]:
    rows, kind = key
    return {"inferscale.step.rows": rows, "inferscale.step.kind": kind}


def error_type(e: BaseException) -> str:
    """``error.type``: low cardinality, as the semantic conventions ask: the HTTP status of an API error, else the
    exception's qualified class name."""
    status = getattr(e, "status", None)
    if isinstance(status, int):
        return str(status)
    cls = type(e)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


class ChatTelemetry:
    """One chat request: its ``chat <model>`` span (a child of the HTTP server span, hence of the caller's
    ``traceparent``) and the GenAI histograms. ``first_token`` once, then ``finish`` or ``fail``, then ``end``."""

    def __init__(self, tracer: trace.Tracer, meters: ServerMetrics, *, model: str, mode: str,
                 request: dict[str, Any], started: float | None = None) -> None:
        self.t0 = started if started is not None else time.perf_counter()  # perf_counter when the request came in
        self.t_first: float | None = None
        self.meters = meters
        self.attrs: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": PROVIDER,
                                      "gen_ai.request.model": model, "inferscale.mode": mode}
        # INTERNAL: the HTTP span from the FastAPI instrumentation is this request's SERVER span.
        self.span = tracer.start_span(f"chat {model}", kind=trace.SpanKind.INTERNAL, attributes={
            **self.attrs, **{k: v for k, v in request.items() if v is not None}})
        self.context = trace.set_span_in_context(self.span)

    def set_mode(self, mode: str) -> None:
        self.attrs["inferscale.mode"] = mode
        self.span.set_attribute("inferscale.mode", mode)

    def first_token(self, at: float | None = None) -> float:
        """Record TTFT (``at``: perf_counter of the first token, default now); returns it in seconds."""
        self.t_first = at if at is not None else time.perf_counter()
        ttft = self.t_first - self.t0
        self.span.set_attribute("gen_ai.server.time_to_first_token", ttft)
        self.span.set_attribute("inferscale.ttft_ms", ttft * 1000)
        self.meters.ttft.record(ttft, self._metric_attrs())
        return ttft

    def finish(self, *, response_id: str, model: str, prompt_tokens: int, completion_tokens: int,
               memory_tokens: int, finish_reasons: Sequence[str]) -> None:
        now = time.perf_counter()
        self.attrs["gen_ai.response.model"] = model
        self.span.set_attributes({
            "gen_ai.response.id": response_id, "gen_ai.response.model": model,
            "gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": completion_tokens,
            "gen_ai.response.finish_reasons": list(finish_reasons), "inferscale.memory_tokens": memory_tokens})
        attrs = self._metric_attrs()
        self.meters.duration.record(now - self.t0, attrs)
        if self.t_first is not None and completion_tokens > 1:
            self.meters.tpot.record((now - self.t_first) / (completion_tokens - 1), attrs)
        self.meters.prompt_tokens.add(prompt_tokens, attrs)
        self.meters.memory_tokens.add(memory_tokens, attrs)
        self.meters.generation_tokens.add(completion_tokens, attrs)
        for reason in finish_reasons:
            self.meters.request_success.add(1, {**attrs, "finished_reason": reason})

    def fail(self, e: BaseException, *, message: str | None = None) -> None:
        kind = error_type(e)
        self.span.set_attribute("error.type", kind)
        self.span.record_exception(e)
        self.span.set_status(trace.Status(trace.StatusCode.ERROR, message or str(e)))
        self.meters.duration.record(time.perf_counter() - self.t0, {**self._metric_attrs(), "error.type": kind})

    def end(self) -> None:
        self.span.end()

    def _metric_attrs(self) -> dict[str, Any]:
        return dict(self.attrs)
