"""``inferscale bench load``: the real server under concurrent streaming clients, ``kv`` and ``text`` side by side.

The server runs in this process on loopback (uvicorn, the production app); clients are the official ``openai``
async client, in a process of their own (loadclients.py). Every request is forced to the same output length with
vLLM's ``ignore_eos``. Per N concurrent streams and mode it reports: tokens/s (all completion tokens / wall time of
the N streams), the aggregate decode rate over the whole span (from the first stream's first token to the last
one's last: the later prompts' prefills interleave with it) and while all N decode (``steady``), TTFT p50/p95,
time per output token p50/p95, and the TTFT of one request that arrives while N-1 streams decode against the same
request's on the idle server (the median of three, after one request that pays the client's first-use costs: a
new client's first TTFT read 160-240 ms against ~100), the cores the client process used while the N streams ran
(``client``: on a machine the server shares, CPU the engine's threads did not get, as they would with the clients
elsewhere), and the engine's own step beside the client's time per token (``engine step``: the mean of the server's
steps that decoded exactly N rows and nothing else, from the tally /metrics exports; ``engine/steptally.py``). TTFT
ends at the first chunk with visible content, as aiperf and the SDK's users count it.

Beside them (issue 22) it measures, in the same process and thread settings, the decode step's floor: the model's
weight bytes over the read bandwidth of a reduction over its largest weight (the embedding, which is the LM head);
and it prints the single-stream step (TPOT p50 at N=1) against that floor and each N's tokens/s against N=1's.
``--flood`` adds issue 12's scenario on a second server with the production queue settings: tenant A sends
``--flood-requests`` long ``text`` requests (k=``--flood-k``; ``--flood-words`` pastes a document of that many
words before each question), then tenant B sends kv requests (k=3, one token);
B's TTFT against its idle TTFT, and how fast A's excess is refused. ``--hold`` does the same on that server with
tenant A's kv requests (k=``-k``), one for each of its ``HOLD_REQUESTS`` slots, each 4x ``--tokens`` long: a burst
that would take every slot and keep it for a whole answer (engine/capacity.py holds some back). ``--repeats`` runs it
all again on the same servers and reports medians with min and max.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

from inferscale.bench.floor import decode_floor
from inferscale.bench.loadclients import B_K, KEYS, LATE_REFUSAL_S, QUESTION, concurrent, flood
from inferscale.bench.repeats import print_spread, spread
from inferscale.contract import DEFAULT_ENGINE, ENGINES
from inferscale.engine.steptally import since
from inferscale.engine.threads import usable_cores
from inferscale.errors import ConfigError

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name or path (default: embedded gemma-3-270m)")
    p.add_argument("--n", default="1,4,16,32", help="comma-separated numbers of concurrent streams")
    p.add_argument("--modes", default="kv,text", help="comma-separated modes, run side by side")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request (forced with ignore_eos)")
    p.add_argument("--extra-body", default=None,
                   help='JSON object of more request fields for the load streams, e.g. \'{"min_tokens": 64}\' (how '
                        'aiperf forces a length) or \'{"temperature": 0.7, "top_p": 0.9}\' (sampled answers)')
    p.add_argument("-k", type=int, default=20, help="memories per request")
    p.add_argument("--users", type=int, default=1,
                   help="users the N streams ask as, each with k memories and a question of its own (1: one user's "
                        "concurrent questions, the same question N times)")
    p.add_argument("--flood", action="store_true", help="also run the tenant flood scenario (issue 12)")
    p.add_argument("--hold", action="store_true",
                   help="also run a hold: tenant A's long kv answers, one for each slot, then tenant B's probes")
    p.add_argument("--flood-requests", type=int, default=32, help="tenant A's long text requests in the flood")
    p.add_argument("--flood-k", type=int, default=40, help="memories in each of tenant A's flood requests")
    p.add_argument("--flood-words", type=int, default=0,
                   help="words of a pasted document before each of tenant A's questions (a flood of long prompts)")
    p.add_argument("--repeats", type=int, default=1, help="run every measurement this many times (medians)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write a PNG of aggregate tokens/s vs N")
    p.add_argument("--device", default=None)
    p.add_argument("--torch-threads", type=int, default=0,
                   help="the server's torch threads (INFERSCALE_TORCH_THREADS): 0 every core, -1 tuned between 1 and all")
    p.add_argument("--engine", choices=ENGINES, default=DEFAULT_ENGINE,
                   help="the server's engine backend (inferscale serve --engine): pytorch or trtllm")


class LiveServer:
    """The production app on a free loopback port, in a thread of this process."""

    def __init__(self, model: str | None, device: str | None, max_tokens: int, engine: str = DEFAULT_ENGINE,
                 torch_threads: int = 0, **scheduler) -> None:
        from inferscale.bench.live import LoopbackServer
        from inferscale.server.app import create_app
        from inferscale.server.auth import hash_key
        from inferscale.server.settings import Settings

        self.data = Path(tempfile.mkdtemp(prefix="inferscale-bench-load-"))
        tenants = self.data / "tenants.json"
        tenants.write_text(json.dumps({t: {"keys": [hash_key(k)], "max_in_flight": 128, "max_k": 64,
                                           "max_tokens": max_tokens} for t, k in KEYS.items()}))
        overrides = {"model": model} if model else {}
        queueing = scheduler or {"max_active": 128, "max_queued_per_tenant": 128, "queue_timeout_s": 600}
        settings = Settings(data_dir=self.data, tenants_file=tenants, device=device, max_tokens=max_tokens,
                            max_in_flight=128, engine=engine, torch_threads=torch_threads, **queueing, **overrides)
        self.app = create_app(settings)
        self.live = LoopbackServer(self.app)
        self.url = self.live.url
        self.model = settings.model

    def close(self) -> None:
        self.live.close()


def _in_engine(server: LiveServer) -> int:
    """Requests running or queued in the engine. Read in process: no endpoint shows load to a tenant."""
    worker = server.app.state.worker
    return worker.active + worker.queued


def _floor(server: LiveServer) -> dict:
    """The decode step's floor (``floor.decode_floor``) for the server's model, beside the threads it decodes on."""
    import torch

    loop = getattr(server.app.state.worker, "loop", None)  # the PyTorch backend's serving loop
    tuner = getattr(loop, "threads", None)
    threads = tuner.current if tuner is not None and tuner.active else torch.get_num_threads()
    return decode_floor(server.app.state.engine.loaded.model, threads)


def _measured(server: LiveServer, mode: str, n: int, k: int, tokens: int, extra: dict, users: int = 1) -> dict:
    """One ``concurrent`` run, with the engine's own n-row decode step over it: the mean of the server's steps that
    decoded exactly n rows and nothing else (its ``StepTally``, which /metrics exports), beside the client's time per
    token (on a machine the clients share, their CPU and the event loop's slow the step itself too)."""
    worker = server.app.state.worker
    before = worker.step_totals
    row = concurrent(server.url, server.model, mode, [stream_asks(i, users) for i in range(n)], k, tokens, extra)
    steps = since(worker.step_totals, before).get((n, "decode"))
    row["engine_steps"] = steps.steps if steps else 0
    row["engine_step_ms"] = steps.mean_s * 1e3 if steps else None
    return row


def stream_asks(i: int, users: int) -> tuple[str, str]:
    """The user stream ``i`` of ``users`` asks as and its question: "maya" and ``QUESTION`` for the first (every
    stream, with one user: one user's concurrent questions), else user i mod users, whose memories are a set of
    their own (``_load_memories``), with one of the synthetic memories' questions."""
    from inferscale.bench.synthetic import QUESTIONS

    u = i % users
    return ("maya", QUESTION) if u == 0 else (f"user-{u}", QUESTIONS[(u - 1) % len(QUESTIONS)])


def _load_memories(server: LiveServer, k: int, users: int = 1) -> None:
    """k synthetic memories for "maya" of both tenants, and for tenant A's other ``users`` a set of their own."""
    import httpx

    from inferscale.bench.synthetic import put_body, synthetic_memories

    engine = server.app.state.engine
    loads = [(tenant, 0) for tenant in KEYS] + [("bench-a", u) for u in range(1, users)]
    for tenant, u in loads:
        body = put_body(synthetic_memories(max(k, 1), engine.tokenizer, seed=u))
        r = httpx.put(f"{server.url}/v1/memories/{stream_asks(u, users)[0]}", json=body,
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=3600)
        if r.status_code != 200:
            raise ConfigError(f"bench load: loading memories for {tenant} failed: {r.status_code} {r.text[:200]}")


def _summary(floor: dict, rows: list[dict], flood: dict | None, hold: dict | None = None) -> dict:
    """The ratios issue 22's bar reads, from one repeat."""
    one = {r["mode"]: r for r in rows if r["n"] == 1}
    top = max(r["n"] for r in rows)
    out = {"floor_ms": floor["floor_ms"]}
    for mode, r in one.items():
        out[f"{mode}_step_ms"] = r["tpot_p50_ms"]
        out[f"{mode}_step_over_floor"] = r["tpot_p50_ms"] / floor["floor_ms"]
        wide = next(w for w in rows if w["mode"] == mode and w["n"] == top)
        out[f"{mode}_tokens_per_s_{top}_over_1"] = wide["tokens_per_s"] / r["tokens_per_s"]
        out[f"{mode}_decode_tokens_per_s_{top}_over_1"] = wide["decode_tokens_per_s"] / r["decode_tokens_per_s"]
        out[f"{mode}_steady_tokens_per_s_{top}_over_1"] = wide["steady_tokens_per_s"] / r["steady_tokens_per_s"]
        if r["engine_step_ms"] and wide["engine_step_ms"]:  # the same ratio from the engine's own steps
            out[f"{mode}_engine_tokens_per_s_{top}_over_1"] = top * r["engine_step_ms"] / wide["engine_step_ms"]
    if flood:
        out["flood_ratio"] = flood["ratio"]
        out["flood_refused_p50_ms"] = flood["a_refused_p50_ms"]
        out["flood_refused_max_ms"] = flood["a_refused_max_ms"]
        out["flood_refused_late"] = len(flood["a_refused_late_ms"])
    if hold:
        out["hold_ratio"] = hold["ratio"]
        out["hold_refused_late"] = len(hold["a_refused_late_ms"])
    return out


# A pasted document's words in a flood prompt, at most: past the server's prompt bound (in tokens) it is refused
# outright and floods nothing.
MAX_FLOOD_WORDS = 4000
# The flood server's slots (INFERSCALE_MAX_ACTIVE), and the requests of ``--hold``'s burst: one for each.
HOLD_REQUESTS = 64


def run(args: argparse.Namespace) -> int:
    ns = sorted({int(n) for n in args.n.split(",") if n.strip()})
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not ns or ns[0] < 1:
        raise ConfigError(f"--n {args.n!r}: expected positive integers")
    if args.tokens < 2 or args.k < 0 or args.repeats < 1 or args.users < 1:
        raise ConfigError("--tokens must be 2 or more, -k 0 or more, --users and --repeats 1 or more")
    if not 0 <= args.flood_words <= MAX_FLOOD_WORDS:
        raise ConfigError(f"--flood-words {args.flood_words}: expected 0 to {MAX_FLOOD_WORDS}")
    extra = _extra_body(args.extra_body)
    repeats = []
    server = LiveServer(args.model, args.device, max_tokens=args.tokens * 4, engine=args.engine,
                        torch_threads=args.torch_threads)
    try:
        _load_memories(server, args.k, args.users)
        for _ in range(args.repeats):
            repeats.append({"floor": _floor(server),
                            "rows": [_measured(server, mode, n, args.k, args.tokens, extra, args.users)
                                     for n in ns for mode in modes]})
    finally:
        server.close()
    if args.flood or args.hold:  # the production queue settings: a request that would outwait them is refused
        server = LiveServer(args.model, args.device, max_tokens=args.tokens * 4, engine=args.engine,
                            torch_threads=args.torch_threads, max_active=HOLD_REQUESTS,
                            max_queued_per_tenant=64, queue_timeout_s=30)
        try:
            _load_memories(server, max(args.flood_k, B_K, args.k))
            for rep in repeats:
                if args.flood:
                    rep["flood"] = flood(server.url, server.model, args.flood_k, args.tokens, args.flood_requests,
                                         lambda: _in_engine(server), args.flood_words)
                if args.hold:
                    rep["hold"] = flood(server.url, server.model, args.k, args.tokens * 4, HOLD_REQUESTS,
                                        lambda: _in_engine(server), mode="kv",
                                        running=lambda: server.app.state.worker.active)
        finally:
            server.close()
    summaries = [_summary(r["floor"], r["rows"], r.get("flood"), r.get("hold")) for r in repeats]
    result = {"model": server.model, "device": args.device or "cpu", "cores": usable_cores(),
              "torch_threads": __import__("torch").get_num_threads(), "platform": platform.platform(),
              "tokens": args.tokens, "k": args.k, "users": args.users, "extra_body": extra, "repeats": repeats,
              "summary": spread(summaries),
              # the first repeat's rows under the names earlier versions wrote
              "rows": repeats[0]["rows"], "flood": repeats[0].get("flood"), "hold": repeats[0].get("hold"),
              "floor": repeats[0]["floor"]}
    for rep in repeats:
        _print(result, rep)
    _print_summary(result["summary"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        _plot(result, modes, args.plot)
    return 0


def _extra_body(text: str | None) -> dict:
    """``--extra-body``: a JSON object (ConfigError naming what is wrong)."""
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--extra-body {text!r}: not JSON ({e})") from None
    if not isinstance(extra, dict):
        raise ConfigError(f"--extra-body {text!r}: expected a JSON object")
    return extra


def _print(result: dict, rep: dict) -> None:
    fl = rep["floor"]
    extra = f" with {json.dumps(result['extra_body'])}" if result["extra_body"] else ""
    users = f", {result['users']} users" if result.get("users", 1) > 1 else ""
    print(f"bench load: {result['model']}, {result['tokens']} tokens per request{extra}, k={result['k']}{users}; "
          f"decode floor {fl['floor_ms']:.1f} ms ({fl['weight_bytes'] / 1e9:.3f} GB of weights at "
          f"{fl['read_gb_per_s']:.1f} GB/s, {fl['floor_threads']} threads; the engine decodes on "
          f"{fl['torch_threads']} now)")
    print(f"{'N':>3} {'mode':<5} {'tok/s':>8} {'decode':>8} {'steady':>8} {'TTFT p50':>9} {'p95':>8} {'TPOT p50':>9} "
          f"{'p95':>8} {'engine step':>12} {'arrival TTFT':>13} {'idle TTFT':>10}  (ms) {'client':>7} (cores)")
    for r in rep["rows"]:
        arrival = f"{r['arrival_ttft_ms']:.1f}" if r["arrival_ttft_ms"] is not None else "-"
        engine = f"{r['engine_step_ms']:.1f}" if r.get("engine_step_ms") is not None else "-"
        print(f"{r['n']:>3} {r['mode']:<5} {r['tokens_per_s']:>8.1f} {r['decode_tokens_per_s']:>8.1f} "
              f"{r['steady_tokens_per_s']:>8.1f} {r['ttft_p50_ms']:>9.1f} {r['ttft_p95_ms']:>8.1f} "
              f"{r['tpot_p50_ms']:>9.1f} {r['tpot_p95_ms']:>8.1f} {engine:>12} {arrival:>13} {r['idle_ttft_ms']:>10.1f}"
              f"       {r['client_cores']:>7.2f}")
    f = rep.get("flood")
    if f:
        shed = _refusals(f)
        if f["host_steal_s"]:
            shed += f", the host took {f['host_steal_s']:.2f} s of CPU meanwhile (steal)"
        long_ = f", {f['flood_question_chars']}-character prompts" if f.get("flood_question_chars", 0) > 200 else ""
        print(f"flood: {f['flood_requests']} text requests (k={f['flood_k']}{long_}) of tenant A, {shed}; tenant B's TTFT "
              f"{f['b_flood_ttft_ms']:.1f} ms vs {f['b_idle_ttft_ms']:.1f} ms idle ({f['ratio']:.2f}x)")
    h = rep.get("hold")
    if h:
        print(f"hold: {h['flood_requests']} kv requests (k={h['flood_k']}) of {h['flood_tokens']} tokens of tenant A, "
              f"one for each slot, {_refusals(h)}; tenant B's TTFT {h['b_flood_ttft_ms']:.1f} ms vs "
              f"{h['b_idle_ttft_ms']:.1f} ms idle ({h['ratio']:.2f}x)")


def _refusals(f: dict) -> str:
    """How many of tenant A's requests were refused, how soon, and which of them late."""
    if not f["a_refused"]:
        return "none refused"
    text = f"{f['a_refused']} refused after {f['a_refused_p50_ms']:.0f} ms p50, {f['a_refused_max_ms']:.0f} max"
    late = f["a_refused_late_ms"]
    if late:
        text += (f" ({len(late)} of them {LATE_REFUSAL_S:g} s or more after sending: "
                 f"{', '.join(f'{ms:.0f}' for ms in late)} ms)")
    return text


def _print_summary(summary: dict) -> None:
    print_spread(summary, 28)
    # Issue 22's bar, read off the lines above: the single-stream step against the floor, N streams against one.
    for key, v in summary.items():
        if key.endswith("_step_over_floor"):
            print(f"bar: {key.removesuffix('_step_over_floor')} single-stream step / floor = {v['median']:.2f}x "
                  f"(bar <= 1.5x)")
        elif "_decode_tokens_per_s_" in key or "_steady_tokens_per_s_" in key:
            steady = "_steady_" in key
            mode, ratio = key.split("_steady_tokens_per_s_" if steady else "_decode_tokens_per_s_")
            what = "while all decode" if steady else "over the whole span"
            print(f"bar: {mode} aggregate decode tokens/s {what}, {ratio.replace('_over_', ' streams / ')} stream = "
                  f"{v['median']:.2f}x (bar >= 8x)")
        elif "_engine_tokens_per_s_" in key:  # beside the bar, not the bar: what the engine did inside the server
            mode, ratio = key.split("_engine_tokens_per_s_")
            print(f"beside it: {mode} the engine's own decode steps inside the server (its step tally), "
                  f"{ratio.replace('_over_', ' rows / ')} row = {v['median']:.2f}x")


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

