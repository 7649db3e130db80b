"""``inferscale bench isolation``: can tenant B learn anything about tenant A from its own TTFT?

A timing audit in the manner of Gu et al., "Auditing Prompt Caching in Language Model APIs" (ICML 2025): the
attacker (tenant B) sends probes of two kinds in random order and asks whether their TTFT distributions differ,
with a two-sample Kolmogorov-Smirnov test. Two audits, each against a real server on loopback, called with the
official ``openai`` client (streaming; TTFT = first content chunk as the client sees it):

  hit vs random   B's question is the text of one of A's stored memories, or random words of the same length.
                  A shared cache (prefix cache, KV blocks, retrieval) would make the former faster.
  active vs idle  before each probe A has just been served (its memories hot in DRAM) or has been silent for
                  as long. Shared tiers (one DRAM LRU) would make B's probe slower after A's activity.
The probes run one at a time: this audits the cache state, not contention for the compute (on a shared engine
a concurrent flood is visible as load; bounding that is the fair queue's job). p > 0.05 = indistinguishable.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from inferscale.bench.progress import progress

KEYS = {"victim": "isk-bench-victim", "prober": "isk-bench-prober"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name or path (default: embedded gemma-3-270m)")
    p.add_argument("--random-weights", default=None, metavar="SHAPE", help="a random-weight model of this shape")
    p.add_argument("--probes", type=int, default=60, help="probes per kind (two kinds per audit)")
    p.add_argument("--memories", type=int, default=20, help="memories stored for each tenant")
    p.add_argument("--k", type=int, default=5, help="memories retrieved per request")
    p.add_argument("--dram-budget-bytes", type=int, default=256 << 20)
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results here")


def ks_2samp(a: list[float], b: list[float]) -> tuple[float, float]:
    """Two-sided two-sample KS: (D, p). scipy's when installed, else D exactly and p from the Kolmogorov
    distribution with Stephens' small-sample correction."""
    try:
        from scipy.stats import ks_2samp as scipy_ks

        r = scipy_ks(a, b)
        return float(r.statistic), float(r.pvalue)
    except ImportError:
        pass
    import numpy as np

    xa, xb = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([xa, xb])
    d = float(np.max(np.abs(np.searchsorted(xa, grid, "right") / len(xa)
                            - np.searchsorted(xb, grid, "right") / len(xb))))
    en = math.sqrt(len(xa) * len(xb) / (len(xa) + len(xb)))
    lam = (en + 0.12 + 0.11 / en) * d
    if lam < 0.3:  # Q_KS(0.3) = 1 - 1e-5; the alternating series does not converge down here
        return d, 1.0
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, float(min(1.0, max(0.0, p)))


def summary(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"n": len(s), "median_ms": round(statistics.median(s), 3), "p10_ms": round(s[len(s) // 10], 3),
            "p90_ms": round(s[min(len(s) - 1, (9 * len(s)) // 10)], 3)}


class _Server:
    """create_app behind uvicorn on a free loopback port, in a thread."""

    def __init__(self, args: argparse.Namespace, data: Path) -> None:
        from inferscale.bench.live import LoopbackServer
        from inferscale.retrieval import Embedder
        from inferscale.server.app import create_app
        from inferscale.server.auth import hash_key
        from inferscale.server.settings import Settings

        tenants = data / "tenants.json"
        tenants.write_text(json.dumps({t: [hash_key(k)] for t, k in KEYS.items()}))
        settings = Settings(data_dir=data, tenants_file=tenants, dram_budget_bytes=args.dram_budget_bytes,
                            device=args.device, **({"model": args.model} if args.model else {}))
        engine = None
        if args.random_weights:
            from inferscale.bench.random_model import random_engine

            engine = random_engine(args.random_weights, device=args.device, dtype=None)
        self.app = create_app(settings, engine=engine, embedder=Embedder())
        self.model = settings.model
        self.live = LoopbackServer(self.app)
        self.url = self.live.url

    def client(self, tenant: str):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=300)

    def close(self) -> None:
        self.live.close()


def ttft_ms(client, model: str, user: str, question: str, k: int) -> float:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model, user=user, max_tokens=1, stream=True,
                                            messages=[{"role": "user", "content": question}],
                                            extra_body={"inferscale": {"k": k}})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:  # the first visible content, as aiperf counts it
            ms = (time.perf_counter() - t0) * 1000
            stream.close()
            return ms
    return (time.perf_counter() - t0) * 1000


def run(args: argparse.Namespace) -> int:
    import httpx

    from inferscale.bench.synthetic import QUESTIONS, put_body, synthetic_memories
    from inferscale.errors import ConfigError

    if args.probes < 2 or args.memories < 1:
        raise ConfigError("--probes must be >= 2 and --memories >= 1")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="inferscale-isolation-") as tmp:
        srv = _Server(args, Path(tmp))
        try:
            tok = srv.app.state.engine.tokenizer
            mems = {"victim": synthetic_memories(args.memories, tok, seed=args.seed + 1),
                    "prober": synthetic_memories(args.memories, tok, seed=args.seed + 2)}
            for tenant, user in (("victim", "alice"), ("prober", "bob")):
                r = httpx.put(f"{srv.url}/v1/memories/{user}", json=put_body(mems[tenant]), timeout=600,
                              headers={"Authorization": f"Bearer {KEYS[tenant]}"})
                r.raise_for_status()
            a, b = srv.client("victim"), srv.client("prober")
            victim_ask = lambda: ttft_ms(a, srv.model, "alice", rng.choice(QUESTIONS), args.k)  # noqa: E731
            probe = lambda q: ttft_ms(b, srv.model, "bob", q, args.k)  # noqa: E731
            for _ in range(3):  # warm up both tenants' paths
                victim_ask(), probe(rng.choice(QUESTIONS))
            words = [w for m in mems["prober"] for w in m.text.rstrip(".").split()]
            samples: dict[str, list[float]] = {"hit": [], "random": [], "active": [], "idle": []}
            kinds = ["hit", "random"] * args.probes
            rng.shuffle(kinds)
            with progress(total=len(kinds), desc="hit vs random", unit="probe") as bar:
                for kind in kinds:
                    text = rng.choice(mems["victim"]).text
                    if kind == "random":
                        text = " ".join(rng.choice(words) for _ in text.split()) + "."
                    samples[kind].append(probe(text))
                    bar.update()
            kinds = ["active", "idle"] * args.probes
            rng.shuffle(kinds)
            with progress(total=len(kinds), desc="active vs idle", unit="probe") as bar:
                for kind in kinds:
                    t0 = time.perf_counter()
                    if kind == "active":
                        victim_ask()
                    else:  # as long as A's request would take, so both kinds probe at the same pace
                        time.sleep(statistics.median(samples["hit"]) / 1000)
                    time.sleep(max(0.0, 0.05 - (time.perf_counter() - t0)))
                    samples[kind].append(probe(rng.choice(QUESTIONS)))
                    bar.update()
        finally:
            srv.close()
    out = {"model": srv.app.state.engine.loaded.name, "probes": args.probes, "memories": args.memories, "k": args.k,
           "groups": {k: summary(v) for k, v in samples.items()}, "ks": {}}
    for left, right in (("hit", "random"), ("active", "idle")):
        d, p = ks_2samp(samples[left], samples[right])
        out["ks"][f"{left}_vs_{right}"] = {"D": round(d, 4), "p": round(p, 4), "indistinguishable": p > 0.05}
    print(f"bench isolation: {out['model']}, {args.probes} probes per kind, k={args.k}")
    print(f"{'group':8} {'median ms':>10} {'p10':>8} {'p90':>8}")
    for name, g in out["groups"].items():
        print(f"{name:8} {g['median_ms']:10.2f} {g['p10_ms']:8.2f} {g['p90_ms']:8.2f}")
    for name, r in out["ks"].items():
        print(f"KS {name}: D={r['D']:.3f} p={r['p']:.3f} -> {'indistinguishable' if r['indistinguishable'] else 'DISTINGUISHABLE'}")
    if args.json:
        out["samples_ms"] = {k: [round(x, 3) for x in v] for k, v in samples.items()}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0
