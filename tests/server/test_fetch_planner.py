"""The fetch-or-recompute planner in the request path (inferscale/store/fetcher.py), on a live server over the tiny
engine: with the disk tier really throttled (a token-bucket reader under the store's disk reads) below break-even,
a kv request recomputes its memories instead of fetching them, its TTFT is lower than a forced fetch's in the same
run, and it answers as text mode does; DRAM-resident blocks, and the disk fast again, are fetched."""

from __future__ import annotations

import statistics

import httpx
import pytest

from conftest import MODEL, _serve
from inferscale.contract import user_store_id
from inferscale.store.throttle import ThrottledReader

USER = "planner-user"
ITEMS = [
    {"id": "p1", "text": "caroline went to a support group in may"},
    {"id": "p2", "text": "melanie painted the beach at sunset"},
    {"id": "p3", "text": "caroline moved to paris with her dog"},
    {"id": "p4", "text": "melanie went camping with her brother in june"},
    {"id": "p5", "text": "caroline reads a book about her sister"},
]
K = len(ITEMS)
QUESTION = "where did caroline move?"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_engine, embedder):
    """A server of its own: the test throttles its disk and steers its planner."""
    yield from _serve(tmp_path_factory.mktemp("planner"), tiny_engine, embedder)


def _ask(server, mode: str = "kv"):
    """(answer, TTFT in s from the header, the request's kv_fetch span attributes)."""
    server.spans.clear()
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(), timeout=120, json={
        "model": MODEL, "user": USER, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": QUESTION}], "inferscale": {"k": K, "mode": mode}})
    assert r.status_code == 200, r.text
    fetch = [dict(s.attributes) for s in server.spans.get_finished_spans() if s.name == "kv_fetch"]
    assert len(fetch) == (mode != "none")
    return r.json()["choices"][0]["message"]["content"], float(r.headers["x-inferscale-ttft-ms"]) / 1e3, \
        (fetch or [{}])[0]


def _to_disk(server) -> None:
    """Leave the user's blocks on disk only (the source of record): out of DRAM."""
    store = server.app.state.store
    store.dram.drop(lambda key: key[1] == user_store_id(USER))


def test_throttled_disk_recomputes_faster_and_fast_disk_fetches(server):
    state = server.app.state
    store, fetcher = state.store, state.memories.fetcher
    r = httpx.put(f"{server.url}/v1/memories/{USER}", json={"items": ITEMS}, headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    _ask(server, "none")  # the engine measures its prefill (seconds per prompt token) before anything is planned
    assert state.worker.prompt_token_s is not None

    # DRAM-resident (just stored): fetched, every block.
    answer_kv, _, attrs = _ask(server)
    assert attrs["inferscale.kv.plan.tier.dram"] == K and attrs["inferscale.kv.plan.recomputed_blocks"] == 0

    # Disk, not throttled: fetched too (and so measured). Text mode's answer for the fidelity check.
    _to_disk(server)
    answer, _, attrs = _ask(server)
    assert attrs["inferscale.kv.plan.tier.disk"] == K and attrs["inferscale.kv.blocks.disk"] == K
    assert answer == answer_kv
    answer_text, _, _ = _ask(server, "text")

    # Throttle the disk so that one block's read takes 40x its recompute, and at least 60 ms.
    rows = {r.item_id: r for r in store.list("acme", user_store_id(USER))}
    size, tokens = max(r.size for r in rows.values()), max(r.tokens for r in rows.values())
    per_block_s = max(40 * tokens * state.worker.prompt_token_s, 0.06)
    store.disk_reader = ThrottledReader(bytes_per_s=size / per_block_s, burst=1)
    try:
        fetch_ttft, recompute_ttft = [], []
        for _ in range(3):
            fetcher.planning = False  # forced fetch: what fetching costs now (the planner learns it too)
            _to_disk(server)
            answer, ttft, attrs = _ask(server)
            assert attrs["inferscale.kv.blocks.disk"] == K and answer == answer_kv
            fetch_ttft.append(ttft)
            fetcher.planning = True
            _to_disk(server)
            answer, ttft, attrs = _ask(server)
            assert attrs["inferscale.kv.plan.recomputed_blocks"] == K, attrs
            assert attrs["inferscale.kv.plan.recomputed_tokens"] == sum(r.tokens for r in rows.values())
            assert attrs["inferscale.kv.blocks"] == 0 and attrs["inferscale.kv.plan.predicted_s"] > 0
            assert answer == answer_text  # every memory recomputed: the prompt is text mode's
            recompute_ttft.append(ttft)
        print(f"\nplanner test: block {size} B / {tokens} tokens, prefill {state.worker.prompt_token_s * 1e3:.3f} "
              f"ms/token, disk throttled to {size / per_block_s / 1e3:.1f} kB/s; TTFT fetch {fetch_ttft} s, "
              f"recompute {recompute_ttft} s")
        assert statistics.median(recompute_ttft) < statistics.median(fetch_ttft), (recompute_ttft, fetch_ttft)
    finally:
        store.disk_reader = None

    # Fast again: the planner still believes the disk slow until a probe re-measures it, then fetches.
    fetcher.planner.probe_after = 2
    seen = []
    for _ in range(fetcher.planner.probe_after + 2):
        _to_disk(server)
        answer, _, attrs = _ask(server)
        seen.append(attrs.get("inferscale.kv.plan.tier.disk", 0))
        if seen[-1] == K:
            break
    assert seen[-1] == K, seen
    assert answer == answer_kv


def test_a_dram_fetch_measured_slow_never_makes_a_cpu_engine_recompute(server):
    """On a CPU engine DRAM blocks are read in place (``fetcher.resident_tiers``): a DRAM fetch that stalled (the
    interpreter's lock, amid another tenant's load) once made the next kv request recompute its memories and answer
    otherwise. Here the planner is told that DRAM takes seconds a block: the request still injects every block."""
    state = server.app.state
    r = httpx.put(f"{server.url}/v1/memories/{USER}", json={"items": ITEMS}, headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    _ask(server, "none")
    assert state.worker.prompt_token_s is not None
    answer_kv, _, attrs = _ask(server)
    assert attrs["inferscale.kv.plan.tier.dram"] == K
    planner = state.memories.fetcher.planner
    for _ in range(3):
        planner.observe_transfer("dram", 1 << 20, 5.0)  # 5 s a block: far past any recompute
    answer, _, attrs = _ask(server)
    assert attrs["inferscale.kv.plan.tier.dram"] == K and attrs["inferscale.kv.plan.recomputed_blocks"] == 0, attrs
    assert answer == answer_kv
