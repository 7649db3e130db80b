"""``inferscale bench replay``: a synthetic Zipf trace through the real server, held against ``inferscale plan``.

1. A population and trace as ``inferscale plan`` draws them (``capacity.workload.synthetic``: users with lognormal
   memories, Zipf traffic over users, Zipf over each user's memories).
2. The real server (the production app over uvicorn on loopback, the official ``openai`` client) stores every
   user's memories (``PUT /v1/memories``, encoded by the engine), is restarted on the same data dir with a DRAM
   budget of ``--dram-fraction`` of the corpus (a cold DRAM tier, as the simulation starts), and answers one chat
   request per trace entry, in order, one at a time: the question is the text of the trace's first memory for that
   request, so retrieval's top-k starts there, and the server reports which k it injected (``inferscale.items``).
3. Measured, from the store's own counters and meters (read in process: no endpoint shows them to a tenant):
   blocks served from DRAM and from disk, bytes and seconds of each request's fetch.
4. Predicted: ``capacity.simulate`` (the same ``BlockCache`` and ``FetchPlanner`` classes) replays the trace of
   what the server injected, on a node of the same DRAM budget and block size (no device tier: none runs here),
   links set to the rates this run measured, each block its own measured size. Whole-user caching, which the store no longer has, is the same
   simulator's ``whole-user`` mode on that trace and budget. The first third of the trace warms both up.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inferscale.capacity import simulate, workload
from inferscale.errors import ConfigError
from inferscale.store.arena import align_up

TENANT, KEY = "replay", "isk-bench-replay"
NO_RECOMPUTE_TOKENS_S = 1.0  # the server always fetches today: a prefill this slow never wins the plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name or path (default: embedded gemma-3-270m)")
    p.add_argument("--device", default=None)
    p.add_argument("--users", type=int, default=6, help="users on the node")
    p.add_argument("--memories", type=float, default=48, help="mean memories per user (lognormal)")
    p.add_argument("--sigma", type=float, default=0.25, help="lognormal sigma of memories per user")
    p.add_argument("-k", type=int, default=4, help="memories per request")
    p.add_argument("--requests", type=int, default=240, help="requests in the trace (a third warm up)")
    p.add_argument("--user-zipf", type=float, default=1.0)
    p.add_argument("--memory-zipf", type=float, default=1.0)
    p.add_argument("--dram-fraction", type=float, default=0.1, help="DRAM budget as a share of the corpus bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context-tokens", type=int, default=64,
                   help="tokens of earlier memories each one is encoded behind (the server's default is 256: the cache "
                        "does not depend on it, the time to load the corpus does)")
    p.add_argument("--port", type=int, default=0, help="loopback port of the server (0: any free one)")
    p.add_argument("--json", default=None, help="write results here")


@dataclass(frozen=True)
class ReplayConfig:
    users: int = 6
    memories: float = 48
    sigma: float = 0.25
    k: int = 4
    requests: int = 240
    user_zipf: float = 1.0
    memory_zipf: float = 1.0
    dram_fraction: float = 0.1
    seed: int = 0
    port: int = 0

    def __post_init__(self) -> None:
        if self.users < 1 or self.memories < 1 or self.k < 1 or self.requests < 3:
            raise ConfigError("bench replay: users, memories and k must be >= 1, requests >= 3")
        if not 0 < self.dram_fraction < 1:
            raise ConfigError(f"bench replay: --dram-fraction {self.dram_fraction} must lie in (0, 1)")

    def trace(self) -> workload.Trace:
        pop = workload.Population(users=self.users, mu=math.log(self.memories) - self.sigma ** 2 / 2,
                                  sigma=self.sigma, tokens_per_memory=30, daily_active=1.0)
        return workload.synthetic(pop, node_users=self.users, requests=self.requests, k=self.k,
                                  user_zipf=self.user_zipf, memory_zipf=self.memory_zipf, requests_per_s=1.0,
                                  seed=self.seed)


class ReplayServer:
    """The production app over ``data`` with a DRAM budget, on loopback, in this process."""

    def __init__(self, data: Path, engine, embedder, dram_budget: int, port: int) -> None:
        from inferscale.bench.live import LoopbackServer
        from inferscale.server.app import create_app
        from inferscale.server.auth import hash_key
        from inferscale.server.settings import Settings

        tenants = data / "tenants.json"
        tenants.write_text(json.dumps({TENANT: {"keys": [hash_key(KEY)], "max_k": 64, "max_tokens": 8}}))
        settings = Settings(data_dir=data, tenants_file=tenants, dram_budget_bytes=dram_budget, max_tokens=8,
                            default_max_tokens=8, queue_timeout_s=600)
        self.app = create_app(settings, engine=engine, embedder=embedder)
        self.store = self.app.state.store
        # Every retrieved block fetched: the replay measures the tiers' residency against the simulator's; whether a
        # block is recomputed instead is the planner's call, measured by its own test (tests/server/
        # test_fetch_planner.py). A tiny engine's prefill would otherwise recompute the blocks a disk read brings.
        self.app.state.memories.fetcher.planning = False
        self.live = LoopbackServer(self.app, port=port)
        self.model = self.app.state.model_ids[0]

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.live.url + "/v1", api_key=KEY, max_retries=0, timeout=600)

    def close(self) -> None:
        self.live.close()


def _memory_texts(trace: workload.Trace, tokenizer, seed: int) -> list[list[dict]]:
    """Each user's memories: LoCoMo-like facts, numbered so that no two of a user's are the same text."""
    from inferscale.bench.synthetic import synthetic_memories

    out = []
    for u, n in enumerate(trace.memories):
        facts = synthetic_memories(int(n), tokenizer, seed=seed * 7919 + u)
        out.append([{"id": f"m{i:04d}", "text": f"{f.text} (note {i} of user {u})"} for i, f in enumerate(facts)])
    return out


def _store_memories(server: ReplayServer, texts: list[list[dict]]) -> dict[tuple[int, int], int]:
    """PUT every user's memories; returns the bytes the DRAM tier counts for each block: (user, memory) -> its
    plain image, aligned to the arena's slots."""
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    sizes: dict[tuple[int, int], int] = {}
    for u, items in enumerate(texts):
        r = httpx.put(f"{server.live.url}/v1/memories/u{u}", json={"items": items}, headers=headers, timeout=3600)
        if r.status_code != 200:
            raise ConfigError(f"bench replay: storing user u{u}'s memories failed: {r.status_code} {r.text[:200]}")
        sizes.update({(u, int(i.item_id[1:])): align_up(i.size) for i in server.store.list(TENANT, f"u{u}")})
    return sizes


@dataclass
class Measured:
    """What the real store did over the measured requests."""

    dram_blocks: int
    disk_blocks: int
    bytes_per_request: list[int]
    fetch_s: list[float]
    dram_rate: float  # bytes/s of its DRAM hits and disk loads (what the simulated links are set to)
    disk_rate: float
    injected: list[list[str]]  # every request's items, in the order the store was asked for them


def _replay(server: ReplayServer, trace: workload.Trace, texts: list[list[dict]], k: int, warmup: int) -> Measured:
    client = server.client()
    store, meters = server.store, server.store.transfers
    injected: list[list[str]] = []
    per_req_bytes: list[int] = []
    fetch_s: list[float] = []
    start = dict(store.counters)
    tiers = ("dram", "disk")
    start_totals = {t: meters[t].totals() for t in tiers}
    for n, req in enumerate(trace.requests):
        if n == warmup:
            start = dict(store.counters)
            start_totals = {t: meters[t].totals() for t in tiers}
        before = {t: meters[t].totals() for t in tiers}
        resp = client.chat.completions.create(
            model=server.model, user=f"u{req.user}", max_tokens=1,
            messages=[{"role": "user", "content": texts[req.user][req.blocks[0]]["text"]}],
            extra_body={"inferscale": {"k": k, "mode": "kv"}})
        injected.append(list(reversed(resp.model_dump()["inferscale"]["items"])))  # injection order
        delta = {t: meters[t].totals().minus(before[t]) for t in tiers}
        if n >= warmup:
            per_req_bytes.append(delta["dram"].bytes + delta["disk"].bytes)
            fetch_s.append(delta["dram"].seconds + delta["disk"].seconds)
    client.close()
    moved = {t: meters[t].totals().minus(start_totals[t]) for t in tiers}
    rate = {t: moved[t].bytes / moved[t].seconds if moved[t].seconds > 0 else 1e12 for t in tiers}
    return Measured(store.counters["dram_hits"] - start["dram_hits"], store.counters["disk_reads"] - start["disk_reads"],
                    per_req_bytes, fetch_s, rate["dram"], rate["disk"], injected)


def _predicted(trace: workload.Trace, measured: Measured, budget: int, sizes: simulate.BlockSizes, warmup: int
               ) -> dict:
    """``inferscale plan``'s node simulation of the trace the server served, on the same DRAM budget."""
    requests = [workload.Request(r.user, tuple(int(i[1:]) for i in items))
                for r, items in zip(trace.requests, measured.injected)]
    served = workload.Trace(trace.memories, requests, trace.seconds)
    node = simulate.NodeShape(hbm_bytes=0, dram_bytes=budget, disk_bytes=1 << 50, dram_gbs=measured.dram_rate / 1e9,
                              disk_gbs=measured.disk_rate / 1e9, dram_fixed_s=0.0, disk_fixed_s=0.0,
                              prefill_tokens_s=NO_RECOMPUTE_TOKENS_S)
    common = dict(block_bytes=int(statistics.mean(sizes.values())), block_tokens=30, scale=1.0, question_tokens=0,
                  warmup=warmup, sizes=sizes)
    per_block = simulate.per_block(served, node, **common)
    whole = simulate.whole_user(served, node, **common)
    hits, misses = per_block.served["dram"], per_block.served["disk"]
    return {"dram_hit_rate": hits / max(hits + misses, 1), "per_block": per_block.summary(),
            "whole_user": whole.summary()}


def replay(cfg: ReplayConfig, engine, embedder, work: Path) -> dict:
    """Run the bench over ``engine`` (and ``embedder``) with its data under ``work``; the JSON it writes."""
    trace = cfg.trace()
    warmup = len(trace.requests) // 3
    texts = _memory_texts(trace, engine.tokenizer, cfg.seed)
    t0 = time.perf_counter()
    loader = ReplayServer(work, engine, embedder, 1 << 30, cfg.port)
    try:
        sizes = _store_memories(loader, texts)
    finally:
        loader.close()
    load_s = time.perf_counter() - t0
    corpus = sum(sizes.values())
    block_bytes = int(statistics.mean(sizes.values()))
    budget = max(int(corpus * cfg.dram_fraction), cfg.k * max(sizes.values()))
    server = ReplayServer(work, engine, embedder, budget, cfg.port)  # a cold DRAM tier over the same disk
    t1 = time.perf_counter()
    try:
        measured = _replay(server, trace, texts, cfg.k, warmup)
        stats = server.store.stats()
    finally:
        server.close()
    replay_s = time.perf_counter() - t1
    pred = _predicted(trace, measured, budget, sizes, warmup)
    hit_measured = measured.dram_blocks / max(measured.dram_blocks + measured.disk_blocks, 1)
    per_block_bytes = float(np.mean(measured.bytes_per_request))
    whole_bytes = pred["whole_user"]["bytes_per_request"]
    return {
        "config": {**cfg.__dict__, "corpus_bytes": corpus, "blocks": len(sizes), "block_bytes": block_bytes,
                   "dram_budget_bytes": budget, "measured_requests": len(trace.requests) - warmup,
                   "load_s": load_s, "replay_s": replay_s},
        "dram_hit_rate_measured": hit_measured,
        "dram_hit_rate_predicted": pred["dram_hit_rate"],
        "hit_rate_gap_pp": abs(hit_measured - pred["dram_hit_rate"]) * 100,
        "bytes_per_request_per_block_measured": per_block_bytes,
        "bytes_per_request_per_block_predicted": pred["per_block"]["bytes_per_request"],
        "bytes_per_request_whole_user_simulated": whole_bytes,
        "whole_user_over_per_block_bytes": whole_bytes / per_block_bytes if per_block_bytes else float("inf"),
        "fetch_ms_measured": _ms(measured.fetch_s),
        "fetch_ms_predicted": {"p50": pred["per_block"]["fetch_p50_s"] * 1e3,
                               "p99": pred["per_block"]["fetch_p99_s"] * 1e3,
                               "mean": pred["per_block"]["fetch_mean_s"] * 1e3},
        "fetch_ms_whole_user_simulated": {"p50": pred["whole_user"]["fetch_p50_s"] * 1e3,
                                          "p99": pred["whole_user"]["fetch_p99_s"] * 1e3,
                                          "mean": pred["whole_user"]["fetch_mean_s"] * 1e3},
        "link_gb_per_s_measured": {"dram": measured.dram_rate / 1e9, "disk": measured.disk_rate / 1e9},
        "store": {k: stats[k] for k in ("dram_hits", "disk_reads", "dram_admitted", "dram_rejected", "dram_evicted",
                                        "dram_bypassed", "dram_blocks", "dram_bytes", "dram_budget")},
    }


def _ms(seconds: list[float]) -> dict:
    if not seconds:
        return dict.fromkeys(("p50", "p99", "mean"), float("nan"))
    s = np.asarray(seconds) * 1e3
    return {"p50": float(np.percentile(s, 50)), "p99": float(np.percentile(s, 99)), "mean": float(s.mean())}


def _print(r: dict) -> None:
    c = r["config"]
    print(f"replay: {c['users']} users, {c['blocks']} memories ({c['block_bytes'] / 1e3:.0f} kB each), k={c['k']}, "
          f"{c['requests']} requests ({c['measured_requests']} measured), DRAM {c['dram_budget_bytes'] / 1e6:.1f} MB "
          f"= {c['dram_fraction']:.0%} of {c['corpus_bytes'] / 1e6:.0f} MB")
    print(f"{'':28} {'measured':>12} {'predicted':>12} {'whole-user (sim)':>17}")
    print(f"{'DRAM hit rate':28} {r['dram_hit_rate_measured']:>12.3f} {r['dram_hit_rate_predicted']:>12.3f}")
    print(f"{'MB moved per request':28} {r['bytes_per_request_per_block_measured'] / 1e6:>12.2f} "
          f"{r['bytes_per_request_per_block_predicted'] / 1e6:>12.2f} "
          f"{r['bytes_per_request_whole_user_simulated'] / 1e6:>17.2f}")
    for q in ("p50", "p99", "mean"):
        print(f"{'fetch ms ' + q:28} {r['fetch_ms_measured'][q]:>12.2f} {r['fetch_ms_predicted'][q]:>12.2f} "
              f"{r['fetch_ms_whole_user_simulated'][q]:>17.2f}")
    print(f"hit-rate gap {r['hit_rate_gap_pp']:.2f} pp; whole-user moves {r['whole_user_over_per_block_bytes']:.1f}x "
          f"the bytes of per-block (simulated whole-user: the store caches blocks only)")


def run(args: argparse.Namespace) -> int:
    from inferscale.engine import Engine
    from inferscale.retrieval import Embedder

    cfg = ReplayConfig(users=args.users, memories=args.memories, sigma=args.sigma, k=args.k, requests=args.requests,
                       user_zipf=args.user_zipf, memory_zipf=args.memory_zipf, dram_fraction=args.dram_fraction,
                       seed=args.seed, port=args.port)
    engine = Engine.load(args.model, device=args.device, context_tokens=args.context_tokens)
    work = Path(tempfile.mkdtemp(prefix="inferscale-bench-replay-"))
    try:
        result = replay(cfg, engine, Embedder(), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
