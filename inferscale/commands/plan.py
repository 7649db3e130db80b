"""``inferscale plan``: how many nodes, what hit rate and what fetch time, for your users on your nodes.

Storage is the corpus in each kv dtype (bytes per token from ``kvquant``'s stored layout); hit rates and fetch
times come from replaying a synthetic Zipf trace (or yours, ``--trace``) on one node through the store's own
cache policy and fetch planner (``inferscale.capacity.simulate``). Prints tables; ``--json F`` and ``--plot F``."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from inferscale.contract import KV_DTYPES

GB = 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model and memories")
    m.add_argument("--model", default="llama-3-8b", help="llama-3-8b, llama-3-70b, gemma-3-270m, or an HF config.json")
    m.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES, help="the format simulated (storage: all)")
    m.add_argument("--users", type=int, default=1_000_000)
    m.add_argument("--memories-mu", type=float, default=math.log(200), help="lognormal μ of memories per user")
    m.add_argument("--memories-sigma", type=float, default=1.164, help="lognormal σ of memories per user")
    m.add_argument("--tokens-per-memory", type=int, default=30)
    m.add_argument("--trace", type=Path, default=None, help="CSV/JSONL of requests: user, k, time[, memories]")
    t = p.add_argument_group("traffic")
    t.add_argument("--daily-active", type=float, default=0.10, help="share of users active in a day")
    t.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of traffic over active users")
    t.add_argument("--memory-zipf", type=float, default=1.0, help="Zipf exponent of retrieval over a user's memories")
    t.add_argument("--k", type=int, default=10, help="memories retrieved per request")
    t.add_argument("--request-rate", type=float, default=None, help="fleet requests/s (default: --requests-per-day)")
    t.add_argument("--requests-per-day", type=float, default=10.0, help="requests a day per active user")
    t.add_argument("--question-tokens", type=int, default=64)
    n = p.add_argument_group("node (defaults: one H200 node)")
    n.add_argument("--hbm-gb", type=float, default=40.0, help="HBM for KV")
    n.add_argument("--dram-gb", type=float, default=1000.0)
    n.add_argument("--disk-tb", type=float, default=15.0)
    n.add_argument("--dram-gbs", type=float, default=50.0, help="DRAM→HBM GB/s")
    n.add_argument("--disk-gbs", type=float, default=12.0, help="NVMe→HBM GB/s")
    n.add_argument("--dram-fixed-us", type=float, default=10.0, help="fixed cost per block from DRAM")
    n.add_argument("--disk-fixed-us", type=float, default=80.0, help="fixed cost per block from disk")
    n.add_argument("--prefill-tokens-s", type=float, default=None,
                   help="recompute throughput (default: --flops ÷ (2 × params))")
    n.add_argument("--flops", type=float, default=4.9e14, help="achievable prefill FLOP/s of a node")
    s = p.add_argument_group("simulation")
    s.add_argument("--sample-users", type=int, default=20_000, help="users of a node simulated (budgets scaled)")
    s.add_argument("--sim-requests", type=int, default=30_000, help="requests replayed (the first third warms up)")
    s.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the plan as JSON")
    p.add_argument("--plot", type=Path, default=None,
                   help="write a PNG: fetch times per caching mode, storage per dtype")


def inputs_from(args: argparse.Namespace):
    from inferscale.capacity.fleet import PlanInputs
    from inferscale.capacity.shapes import model_shape
    from inferscale.capacity.simulate import NodeShape
    from inferscale.capacity.workload import Population

    model = model_shape(args.model)
    node = NodeShape(hbm_bytes=int(args.hbm_gb * GB), dram_bytes=int(args.dram_gb * GB),
                     disk_bytes=int(args.disk_tb * 1e12), dram_gbs=args.dram_gbs, disk_gbs=args.disk_gbs,
                     dram_fixed_s=args.dram_fixed_us * 1e-6, disk_fixed_s=args.disk_fixed_us * 1e-6,
                     prefill_tokens_s=args.prefill_tokens_s or model.prefill_tokens_per_s(args.flops))
    pop = Population(users=args.users, mu=args.memories_mu, sigma=args.memories_sigma,
                     tokens_per_memory=args.tokens_per_memory, daily_active=args.daily_active)
    return PlanInputs(model=model, kv_dtype=args.kv_dtype, population=pop, node=node, k=args.k,
                      requests_per_s=args.request_rate, requests_per_active_user_day=args.requests_per_day,
                      user_zipf=args.zipf, memory_zipf=args.memory_zipf, question_tokens=args.question_tokens,
                      sample_users=args.sample_users, sim_requests=args.sim_requests, seed=args.seed,
                      trace=args.trace)


def plot(plan: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    modes = plan["modes"]
    names = list(modes)
    for i, (q, hatch) in enumerate((("fetch_p50_s", ""), ("fetch_p99_s", "//"))):
        left.bar([x + 0.4 * i for x in range(len(names))], [modes[n][q] * 1e3 for n in names], width=0.4,
                 hatch=hatch, label=q[6:9], color=["tab:green", "tab:olive", "tab:red"][: len(names)])
    left.set_xticks([x + 0.2 for x in range(len(names))], names)
    left.legend()
    left.set_yscale("log")
    left.set_ylabel("fetch time per request (ms, log)")
    left.set_title(f"{plan['model']} {plan['kv_dtype']}: per-block vs whole-user")
    dtypes = list(plan["storage_bytes"])
    right.bar(dtypes, [plan["storage_bytes"][d] / 1e15 for d in dtypes], color="tab:blue")
    right.set_ylabel("corpus (PB)")
    right.set_title(f"{plan['users']:,} users: storage per kv dtype")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from inferscale.capacity.fleet import plan_fleet, table

    plan = plan_fleet(inputs_from(args))
    print(table(plan))
    if args.json:
        args.json.write_text(json.dumps(plan, indent=2) + "\n")
    if args.plot:
        plot(plan, args.plot)
    return 0
