"""OpenTelemetry and Prometheus as platform teams run them: a caller's ``traceparent`` continues into the server's
spans, GenAI attributes and histograms, ``/metrics`` in the Prometheus text format with no caller-chosen label,
and log records that carry the trace ids."""

from __future__ import annotations

import logging
import threading
import os
import re
import secrets
import time
import uuid
from pathlib import Path

import httpx
import pytest
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from conftest import MODEL

GENAI_HISTOGRAMS = ("gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token",
                    "gen_ai.server.request.duration")


def _traceparent() -> tuple[str, int, int]:
    trace_id, span_id = secrets.randbits(128) | 1, secrets.randbits(64) | 1
    return f"00-{trace_id:032x}-{span_id:016x}-01", trace_id, span_id


def _trace_spans(live, trace_id: int, *, until_kind: SpanKind = SpanKind.SERVER) -> list:
    """The finished spans of one trace; waits for the HTTP server span, which ends just after the response is sent."""
    deadline = time.monotonic() + 10
    while True:
        spans = [s for s in live.spans.get_finished_spans() if s.context.trace_id == trace_id]
        if any(s.kind == until_kind for s in spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


def _points(live, name: str) -> list:
    data = live.metrics.get_metrics_data()
    return [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics if m.name == name
            for p in m.data.data_points]


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "where did caroline move?"}],
                                          **kw)


def test_traceparent_continues_into_server_spans(live, memories):
    header, trace_id, parent_span = _traceparent()
    live.spans.clear()
    resp = _chat(live.client(default_headers={"traceparent": header}), user="caroline", max_tokens=4,
                 temperature=0.7, top_p=0.9, seed=3, extra_body={"inferscale": {"k": 2, "mode": "kv"}})
    mine = _trace_spans(live, trace_id)
    assert {s.name for s in mine} >= {f"chat {MODEL}", "retrieval", "kv_fetch", "prefill", "decode"}
    http = [s for s in mine if s.kind == SpanKind.SERVER]
    assert len(http) == 1 and http[0].parent.span_id == parent_span and http[0].parent.is_remote
    assert http[0].attributes.get("http.route") == "/v1/chat/completions"
    chat = next(s for s in mine if s.name == f"chat {MODEL}")
    assert chat.parent.span_id == http[0].context.span_id and chat.kind == SpanKind.INTERNAL
    a = chat.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "inferscale"
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.response.id"] == resp.id
    assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9) and a["gen_ai.request.seed"] == 3
    assert a["gen_ai.usage.output_tokens"] == resp.usage.completion_tokens
    assert a["gen_ai.usage.input_tokens"] == resp.usage.prompt_tokens
    assert list(a["gen_ai.response.finish_reasons"]) == [resp.choices[0].finish_reason]
    assert "error.type" not in a


def test_streamed_request_span_and_trace(live, memories):
    header, trace_id, _ = _traceparent()
    live.spans.clear()
    stream = _chat(live.client(default_headers={"traceparent": header}), user="caroline", max_tokens=4, stream=True)
    ids = {chunk.id for chunk in stream}
    chat = [s for s in _trace_spans(live, trace_id) if s.name == f"chat {MODEL}"]
    assert len(chat) == 1
    assert {chat[0].attributes["gen_ai.response.id"]} == ids


def test_genai_histograms(live, memories):
    client = live.client()
    # Sampled at temperature 1 until one answer has two tokens or more: the time per output token needs two.
    for seed in range(20):
        resp = _chat(client, max_tokens=8, temperature=1.0, seed=seed)
        if resp.usage.completion_tokens > 1:
            break
    assert resp.usage.completion_tokens > 1
    for name in GENAI_HISTOGRAMS:
        points = _points(live, name)
        assert points and sum(p.count for p in points) >= 1, name
        assert all(p.attributes["gen_ai.provider.name"] == "inferscale" for p in points)
        assert any(p.attributes.get("gen_ai.request.model") == MODEL and p.sum > 0 for p in points), name
    generated = sum(p.value for p in _points(live, "inferscale.generation_tokens"))
    assert generated >= resp.usage.completion_tokens


def test_failed_request_records_error_type(live):
    live.spans.clear()
    r = httpx.post(live.url + "/v1/chat/completions", headers=live.headers(), timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": " ".join(["caroline"] * 3000)}]})
    assert r.status_code == 400
    chat = [s for s in live.spans.get_finished_spans() if s.name == f"chat {MODEL}"]
    assert len(chat) == 1 and chat[0].attributes["error.type"] == "400"
    failed = [p for p in _points(live, "gen_ai.server.request.duration") if p.attributes.get("error.type") == "400"]
    assert failed and failed[0].count >= 1


def _scrape(live) -> dict[str, list]:
    r = live.scrape()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def test_metrics_parse_and_no_label_is_a_caller_path(live, memories):
    marker = uuid.uuid4().hex
    for path in (f"/{marker}", f"/v1/{marker}/x", f"/v1/chat/{marker}", f"/internal/v1/{marker}"):
        assert httpx.get(live.url + path, headers=live.headers()).status_code == 404
    # A route with a path parameter: counted under its template, not the user's id.
    httpx.get(f"{live.url}/v1/memories/u-{marker}", headers=live.headers())
    httpx.get(f"{live.url}/v1/memories/u-{marker}", headers={"Authorization": "Bearer wrong"})
    # Neither the Host header nor an invented method may become a label value either.
    httpx.get(live.url + "/healthz", headers={"host": f"h-{marker}.example"})
    httpx.request(f"M{marker[:8].upper()}", f"{live.url}/v1/models", headers=live.headers())
    _chat(live.client(), max_tokens=2)
    families = _scrape(live)
    values = {v for samples in families.values() for s in samples for v in s.labels.values()}
    assert not [v for v in values if marker in v or marker[:8].upper() in v]
    routes = {s.labels.get("http_route") for samples in families.values() for s in samples if "http_route" in s.labels}
    assert "/v1/chat/completions" in routes and "/v1/memories/{user}" in routes
    for name in ("gen_ai_server_time_to_first_token_seconds", "gen_ai_server_time_per_output_token_seconds",
                 "gen_ai_server_request_duration_seconds", "inferscale_prompt_tokens", "inferscale_generation_tokens",
                 "inferscale_request_success", "inferscale_num_requests_running", "inferscale_num_requests_waiting"):
        assert name in families, (name, sorted(families))
    reasons = {s.labels["finished_reason"] for s in families["inferscale_request_success"]}
    assert reasons <= {"stop", "length"} and reasons


def test_the_engines_own_steps_are_counted_and_timed_by_rows(live, memories):
    """Issue 22: the serving loop's steps on /metrics, by rows decoded (a bounded set of labels) and kind, with their
    wall time, so an operator reads the engine's mean step beside the clients' time per output token."""
    def decode_steps(families, name):
        return sum(s.value for s in families.get(name, []) if s.labels.get("inferscale_step_rows") == "1"
                   and s.labels.get("inferscale_step_kind") == "decode" and s.name.endswith("_total"))

    before = _scrape(live)
    resp = _chat(live.client(), max_tokens=5, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 5
    after = _scrape(live)
    steps = [s for s in after["inferscale_engine_steps"] if s.name.endswith("_total")]
    assert steps and {s.labels["inferscale_step_kind"] for s in steps} <= {"decode", "mixed", "prompt"}
    assert {s.labels["inferscale_step_rows"] for s in steps} <= {
        "0", "1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65-128", "129-256", "257+"}
    # one request alone: its first token from the prompt's pass, the other four from one-row decode steps
    assert decode_steps(after, "inferscale_engine_steps") - decode_steps(before, "inferscale_engine_steps") >= 4
    assert (decode_steps(after, "inferscale_engine_step_time_seconds")
            > decode_steps(before, "inferscale_engine_step_time_seconds"))


def test_the_share_of_the_kv_budget_held_is_a_gauge(live, memories):
    """INFERSCALE_KV_CACHE_BYTES in use (vLLM's kv_cache_usage_perc): above zero while a request runs, zero after."""
    def usage():
        return _scrape(live)["inferscale_kv_cache_usage"][0].value

    from inferscale.engine.worker import _Call

    worker = live.app.state.worker
    stream = _chat(live.client(), max_tokens=60, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    gate, holding = threading.Event(), threading.Event()  # the engine held between two steps: the request runs on
    hold = _Call(lambda _engine: (holding.set(), gate.wait(60)))
    with worker._cv:
        worker._calls.append(hold)
        worker._cv.notify()
    try:
        assert holding.wait(30)
        during = usage()
    finally:
        gate.set()
        hold.future.result(30)
    for _ in stream:
        pass
    assert 0 < during < 1 and usage() == 0


def test_log_records_carry_trace_ids(live, caplog):
    from inferscale.server.logs import uvicorn_log_config

    tracer = live.app.state.telemetry.tracer
    with caplog.at_level(logging.INFO, logger="inferscale.test"), tracer.start_as_current_span("outer") as span:
        logging.getLogger("inferscale.test").info("inside a span")
    record = next(r for r in caplog.records if r.getMessage() == "inside a span")
    assert record.otelTraceID == format(span.get_span_context().trace_id, "032x")
    assert record.otelSpanID == format(span.get_span_context().span_id, "016x")
    config = uvicorn_log_config()
    assert config["loggers"]["uvicorn.access"]["level"] == "INFO"
    assert "%(otelTraceID)s" in config["formatters"]["access"]["fmt"]


def test_readme_metric_names_are_served(live, memories):
    """Every name in the README's metrics table is on /metrics (after a request, so the histograms have data)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("| Prometheus name (`/metrics`)", 1)[1].split("\n\n", 1)[0]
    names = set()
    for row in table.splitlines()[2:]:
        for name in re.findall(r"`([a-z_]+)(?:\{[^}]*\})?`", re.sub(r"\([^)]*\)", "", row.split("|")[1])):
            names.add(name)
    names = {("inferscale_num_requests" + n) if n.startswith("_") else n for n in names}
    assert len(names) >= 12
    # a kv request with memories: the fetch counters count (alone, this test must not rely on an earlier one's)
    _chat(live.client(), user="caroline", max_tokens=2, extra_body={"inferscale": {"k": 2, "mode": "kv"}})
    # A counter shows up once it has counted: a refusal by a tenant limit is hard to time, so count one here.
    live.app.state.telemetry.metrics.rejected("in_flight")
    families = _scrape(live)
    served = set(families) | {s.name for samples in families.values() for s in samples}
    assert not names - served, sorted(names - served)


def test_serve_log_config_prints_trace_ids_and_access_lines():
    """`inferscale serve`'s logging config, applied in a fresh process: INFO lines with the current trace id, and a
    record made without the OpenTelemetry factory still formats."""
    import subprocess
    import sys

    code = """
import logging, logging.config
from opentelemetry.sdk.trace import TracerProvider
from inferscale.server.logs import inject_trace_ids_into_logs, uvicorn_log_config
logging.config.dictConfig(uvicorn_log_config())
logging.getLogger("inferscale.app").info("before the factory")
inject_trace_ids_into_logs()
with TracerProvider().get_tracer("t").start_as_current_span("s") as span:
    logging.getLogger("inferscale.app").info("inside")
    logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", "/v1/models", "1.1", 200)
    logging.getLogger("inferscale.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "PUT", "/v1/memories/{user}",
                                                "1.1", 404)
    print("TRACE", format(span.get_span_context().trace_id, "032x"), flush=True)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert out.returncode == 0, out.stderr
    trace_id = out.stdout.split("TRACE ", 1)[1].split()[0]
    assert "before the factory trace_id=0" in out.stderr and "Logging error" not in out.stderr
    assert f"inside trace_id={trace_id}" in out.stderr
    assert f'"GET /v1/models HTTP/1.1" 200 OK trace_id={trace_id}' in out.stdout
    assert f'"PUT /v1/memories/{{user}} HTTP/1.1" 404 Not Found trace_id={trace_id}' in out.stdout


def test_access_log_names_the_route_never_the_user(live, caplog):
    """`PUT /v1/memories/alice%40example.com` is logged as `PUT /v1/memories/{user}`: the raw user string (often an
    e-mail address, kept by the store only as an opaque id) never reaches a log line, refused requests included."""
    item = {"items": [{"id": "a1", "text": "alice likes tea"}]}
    with caplog.at_level(logging.INFO, logger="inferscale.access"):
        assert httpx.put(f"{live.url}/v1/memories/alice%40example.com", json=item, headers=live.headers(),
                         timeout=60).status_code == 200
        httpx.get(f"{live.url}/v1/memories/alice%40example.com?q=alice", headers=live.headers())
        httpx.get(f"{live.url}/v1/memories/alice%40example.com", headers={"Authorization": "Bearer wrong"})
        httpx.delete(f"{live.url}/v1/memories/alice%40example.com/a1", headers=live.headers())
        httpx.get(f"{live.url}/nowhere/alice%40example.com")
    lines = [r.getMessage() for r in caplog.records if r.name == "inferscale.access"]
    assert len(lines) == 5 and not [line for line in lines if "alice" in line], lines
    assert sum('"PUT /v1/memories/{user} HTTP/1.1" 200' in line for line in lines) == 1
    assert sum('"GET /v1/memories/{user} HTTP/1.1" 401' in line for line in lines) == 1
    assert sum("/v1/memories/{user}/{item}" in line for line in lines) == 1 and "<no route>" in lines[-1]
