"""Traces: a span per request with children retrieval, kv_fetch, prefill, decode; TTFT attribute and GenAI metric."""

from __future__ import annotations

from conftest import MODEL


def test_span_tree_and_ttft(engine_live, engine_memories):
    engine_live.spans.clear()
    resp = engine_live.client().chat.completions.create(
        model=MODEL, user="caroline", max_tokens=4, messages=[{"role": "user", "content": "where did caroline move?"}],
        extra_body={"inferscale": {"k": 3, "mode": "kv"}})
    assert resp.choices
    spans = engine_live.spans.get_finished_spans()
    roots = [s for s in spans if s.name == f"chat {MODEL}"]
    assert len(roots) == 1
    root = roots[0]
    children = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id}
    assert {"retrieval", "kv_fetch", "prefill", "decode"} <= set(children)
    assert all(s.context.trace_id == root.context.trace_id for s in children.values())
    ttft = root.attributes["gen_ai.server.time_to_first_token"]
    assert 0 < ttft < 30 and root.attributes["inferscale.ttft_ms"] > 0
    fetch = children["kv_fetch"].attributes
    assert fetch["inferscale.kv.blocks"] == 3 and fetch["inferscale.kv.bytes"] > 0 and fetch["inferscale.kv.tier"]
    assert children["prefill"].attributes["inferscale.memory_tokens"] > 0
    assert children["retrieval"].start_time <= children["kv_fetch"].start_time <= children["prefill"].start_time
    assert children["prefill"].end_time <= children["decode"].start_time + 1


def test_ttft_metric(live, memories):
    live.client().chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    data = live.metrics.get_metrics_data()
    points = [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
              if m.name == "gen_ai.server.time_to_first_token" for p in m.data.data_points]
    assert points and sum(p.count for p in points) >= 1
    assert any(p.attributes.get("gen_ai.operation.name") == "chat" for p in points)
