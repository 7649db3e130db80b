"""``inferscale bench load``: the real server under concurrent streaming clients, ``kv`` and ``text`` side by side.

The server runs in this process on loopback (uvicorn, the production app); clients are the official ``openai``
async client. Every request is forced to the same output length with vLLM's ``ignore_eos``. Per N concurrent
streams and mode it reports: aggregate decode tokens/s (all completion tokens / wall time of the N streams), TTFT
p50/p95, time per output token p50/p95, and the TTFT of one request that arrives while N-1 streams decode
against the same request on the idle server. ``--flood`` adds issue 12's scenario: 32 long ``text`` requests from
tenant A queued, then one request of tenant B; B's TTFT against its idle TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from inferscale.contract import DEFAULT_ENGINE, ENGINES
from inferscale.errors import ConfigError

QUESTION = "What did Maya do last summer, and with whom?"
KEYS = {"bench-a": "isk-bench-a", "bench-b": "isk-bench-b"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name or path (default: embedded gemma-3-270m)")
    p.add_argument("--n", default="1,4,16,32", help="comma-separated numbers of concurrent streams")
    p.add_argument("--modes", default="kv,text", help="comma-separated modes, run side by side")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request (forced with ignore_eos)")
    p.add_argument("-k", type=int, default=20, help="memories per request")
    p.add_argument("--flood", action="store_true", help="also run the tenant flood scenario (issue 12)")
    p.add_argument("--flood-requests", type=int, default=32, help="tenant A's long text requests in the flood")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write a PNG of aggregate tokens/s vs N")
    p.add_argument("--device", default=None)
    p.add_argument("--engine", choices=ENGINES, default=DEFAULT_ENGINE,
                   help="the server's engine backend (inferscale serve --engine): pytorch or trtllm")


@dataclass
class Stream:
    ttft_s: float
    tpot_s: float | None  # (last token - first token) / (tokens - 1)
    tokens: int


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


class LiveServer:
    """The production app on a free loopback port, in a thread of this process."""

    def __init__(self, model: str | None, device: str | None, max_tokens: int, engine: str = DEFAULT_ENGINE) -> None:
        from inferscale.bench.live import LoopbackServer
        from inferscale.server.app import create_app
        from inferscale.server.auth import hash_key
        from inferscale.server.settings import Settings

        self.data = Path(tempfile.mkdtemp(prefix="inferscale-bench-load-"))
        tenants = self.data / "tenants.json"
        tenants.write_text(json.dumps({t: {"keys": [hash_key(k)], "max_in_flight": 128, "max_k": 64,
                                           "max_tokens": max_tokens} for t, k in KEYS.items()}))
        overrides = {"model": model} if model else {}
        settings = Settings(data_dir=self.data, tenants_file=tenants, device=device, max_tokens=max_tokens,
                            max_in_flight=128, max_active=128, max_queued_per_tenant=128, queue_timeout_s=600,
                            engine=engine, **overrides)
        self.app = create_app(settings)
        self.live = LoopbackServer(self.app)
        self.url = self.live.url
        self.model = settings.model

    def close(self) -> None:
        self.live.close()


async def _stream(client, model: str, mode: str, k: int, tokens: int, question: str = QUESTION,
                  user: str = "maya", first: asyncio.Event | None = None) -> Stream:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, user=user, stream=True, max_tokens=tokens, messages=[{"role": "user", "content": question}],
        stream_options={"include_usage": True}, extra_body={"inferscale": {"k": k, "mode": mode}, "ignore_eos": True})
    ttft = time.perf_counter() - t0  # the server answers once the first token exists
    if first is not None:
        first.set()
    times, used = [], 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    tpot = (times[-1] - times[0]) / (used - 1) if len(times) >= 2 and used > 1 else None
    return Stream(ttft, tpot, used)


async def _concurrent(url: str, model: str, mode: str, n: int, k: int, tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["bench-a"], max_retries=0, timeout=3600)
    idle = await _stream(client, model, mode, k, tokens)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_stream(client, model, mode, k, tokens) for _ in range(n)))
    wall = time.perf_counter() - t0
    # One more request arriving while n-1 streams decode (longer ones, so they are still decoding when it lands).
    arrival = None
    if n > 1:
        firsts = [asyncio.Event() for _ in range(n - 1)]
        background = [asyncio.create_task(_stream(client, model, mode, k, tokens * 4, first=f)) for f in firsts]
        for f in firsts:  # every one of them is decoding
            await f.wait()
        arrival = (await _stream(client, model, mode, k, tokens)).ttft_s
        await asyncio.gather(*background)
    await client.close()
    ttfts, tpots = [r.ttft_s for r in results], [r.tpot_s for r in results if r.tpot_s is not None]
    return {"mode": mode, "n": n, "tokens_per_s": sum(r.tokens for r in results) / wall,
            "ttft_p50_ms": _pct(ttfts, 0.5) * 1e3, "ttft_p95_ms": _pct(ttfts, 0.95) * 1e3,
            "tpot_p50_ms": _pct(tpots, 0.5) * 1e3, "tpot_p95_ms": _pct(tpots, 0.95) * 1e3,
            "idle_ttft_ms": idle.ttft_s * 1e3, "arrival_ttft_ms": arrival * 1e3 if arrival is not None else None}


def _in_engine(server: LiveServer) -> int:
    """Requests running or queued in the engine. Read in process: no endpoint shows load to a tenant."""
    worker = server.app.state.worker
    return worker.active + worker.queued


async def _wait_for(server: LiveServer, requests: int, timeout_s: float = 3600) -> None:
    """Wait until ``requests`` are in the engine: the background load is in place."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline and _in_engine(server) < requests:
        await asyncio.sleep(0.01)


PROBES = 3  # tenant B's requests, idle and during the flood (medians)


async def _flood(server: LiveServer, model: str, k: int, tokens: int, requests: int) -> dict:
    """Tenant A queues ``requests`` long text prompts; then tenant B sends one kv request."""
    from openai import AsyncOpenAI

    url = server.url

    a = AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["bench-a"], max_retries=0, timeout=3600)
    b = AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["bench-b"], max_retries=0, timeout=3600)
    idle = [(await _stream(b, model, "kv", k, tokens, user="maya")).ttft_s for _ in range(PROBES)]
    flood = [asyncio.create_task(_stream(a, model, "text", k, tokens)) for _ in range(requests)]
    # Every one of A's requests is in the engine (running or queued) before B asks: the whole flood is ahead of B.
    await _wait_for(server, requests)
    during = [(await _stream(b, model, "kv", k, tokens, user="maya")).ttft_s for _ in range(PROBES)]
    in_engine_after = _in_engine(server)
    await asyncio.gather(*flood)
    await a.close()
    await b.close()
    b_idle, b_flood = statistics.median(idle), statistics.median(during)
    return {"flood_requests": requests, "probes": PROBES, "b_idle_ttft_ms": b_idle * 1e3,
            "b_flood_ttft_ms": b_flood * 1e3, "b_flood_ttft_max_ms": max(during) * 1e3,
            "a_in_engine_after_probes": in_engine_after, "ratio": b_flood / b_idle}


def _load_memories(server: LiveServer, k: int) -> None:
    import httpx

    from inferscale.bench.synthetic import synthetic_memories

    engine = server.app.state.engine
    items = synthetic_memories(max(k, 1), engine.tokenizer)
    body = {"items": [{"id": it.id, "text": it.text} for it in items]}
    for tenant, key in KEYS.items():
        r = httpx.put(f"{server.url}/v1/memories/maya", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=3600)
        if r.status_code != 200:
            raise ConfigError(f"bench load: loading memories for {tenant} failed: {r.status_code} {r.text[:200]}")


def run(args: argparse.Namespace) -> int:
    ns = sorted({int(n) for n in args.n.split(",") if n.strip()})
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not ns or ns[0] < 1:
        raise ConfigError(f"--n {args.n!r}: expected positive integers")
    if args.tokens < 2 or args.k < 0:
        raise ConfigError("--tokens must be 2 or more and -k 0 or more")
    server = LiveServer(args.model, args.device, max_tokens=args.tokens * 4, engine=args.engine)
    try:
        _load_memories(server, args.k)
        rows = [asyncio.run(_concurrent(server.url, server.model, mode, n, args.k, args.tokens))
                for n in ns for mode in modes]
        flood = asyncio.run(_flood(server, server.model, args.k, args.tokens, args.flood_requests)) \
            if args.flood else None
    finally:
        server.close()
    result = {"model": server.model, "device": args.device or "cpu", "threads": os.cpu_count(),
              "torch_threads": __import__("torch").get_num_threads(), "platform": platform.platform(),
              "tokens": args.tokens, "k": args.k, "rows": rows, "flood": flood}
    _print(result, modes)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        _plot(result, modes, args.plot)
    return 0


def _print(result: dict, modes: list[str]) -> None:
    print(f"bench load: {result['model']}, {result['tokens']} tokens per request, k={result['k']}")
    print(f"{'N':>3} {'mode':<5} {'tok/s':>8} {'TTFT p50':>9} {'p95':>8} {'TPOT p50':>9} {'p95':>8} "
          f"{'arrival TTFT':>13} {'idle TTFT':>10}  (ms)")
    for r in result["rows"]:
        arrival = f"{r['arrival_ttft_ms']:.1f}" if r["arrival_ttft_ms"] is not None else "-"
        print(f"{r['n']:>3} {r['mode']:<5} {r['tokens_per_s']:>8.1f} {r['ttft_p50_ms']:>9.1f} {r['ttft_p95_ms']:>8.1f} "
              f"{r['tpot_p50_ms']:>9.1f} {r['tpot_p95_ms']:>8.1f} {arrival:>13} {r['idle_ttft_ms']:>10.1f}")
    f = result["flood"]
    if f:
        print(f"flood: {f['flood_requests']} long text requests of tenant A; tenant B's TTFT "
              f"{f['b_flood_ttft_ms']:.1f} ms vs {f['b_idle_ttft_ms']:.1f} ms idle ({f['ratio']:.2f}x)")


def _plot(result: dict, modes: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in modes:
        rows = [r for r in result["rows"] if r["mode"] == mode]
        ax.plot([r["n"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=mode)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(f"bench load: {result['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)

