"""A fleet's plan from the user's numbers: corpus and storage per kv dtype, nodes needed, and one node's
simulated hit rates and fetch times per caching mode (``capacity.simulate``), scaled from a sample of its users."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from inferscale.capacity import simulate, workload
from inferscale.capacity.shapes import ModelShape
from inferscale.errors import ConfigError

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class PlanInputs:
    model: ModelShape
    kv_dtype: str
    population: workload.Population
    node: simulate.NodeShape
    k: int = 10
    requests_per_s: float | None = None  # fleet-wide; None: requests_per_active_user_day
    requests_per_active_user_day: float = 10.0
    user_zipf: float = 1.0
    memory_zipf: float = 1.0
    question_tokens: int = 64
    prefill_utilization: float = 0.5  # share of a node's prefill throughput the plan may spend
    sample_users: int = 20_000
    sim_requests: int = 30_000
    seed: int = 0
    trace: Path | None = None

    def fleet_rate(self) -> float:
        if self.requests_per_s is not None:
            return self.requests_per_s
        pop = self.population
        return pop.users * pop.daily_active * self.requests_per_active_user_day / SECONDS_PER_DAY


def storage_bytes(inputs: PlanInputs, total_memories: float) -> dict[str, int]:
    """The whole corpus on disk (the source of record) in every kv dtype."""
    tokens = total_memories * inputs.population.tokens_per_memory
    return {d: int(round(tokens * bpt)) for d, bpt in inputs.model.all_bytes_per_token().items()}


def _trace(inputs: PlanInputs, node_users: int) -> workload.Trace:
    if inputs.trace is not None:
        return workload.from_file(inputs.trace, inputs.population, memory_zipf=inputs.memory_zipf, seed=inputs.seed)
    return workload.synthetic(inputs.population, node_users=node_users, requests=inputs.sim_requests, k=inputs.k,
                              user_zipf=inputs.user_zipf, memory_zipf=inputs.memory_zipf,
                              requests_per_s=inputs.fleet_rate(), seed=inputs.seed)


def plan_fleet(inputs: PlanInputs) -> dict:
    """Everything ``inferscale plan`` reports, as plain data (the JSON it writes)."""
    pop, node = inputs.population, inputs.node
    if inputs.node.disk_bytes <= 0 or inputs.k < 1:
        raise ConfigError("plan: the node needs disk bytes > 0 and k >= 1")
    tokens = pop.tokens_per_memory
    bpt = inputs.model.bytes_per_token(inputs.kv_dtype)
    trace = _trace(inputs, 1) if inputs.trace is not None else None
    users = len(trace.memories) if trace is not None else pop.users
    total_memories = float(trace.memories.sum()) if trace is not None else users * pop.mean_memories
    storage = storage_bytes(inputs, total_memories)
    nodes_storage = max(1, math.ceil(storage[inputs.kv_dtype] / node.disk_bytes))
    node_users = math.ceil(users / nodes_storage)
    sim_users = min(node_users, inputs.sample_users) if trace is None else node_users
    if trace is None:
        trace = _trace(inputs, sim_users)
    scale = sim_users / node_users
    common = dict(block_bytes=tokens * bpt, block_tokens=tokens, scale=scale,
                  question_tokens=inputs.question_tokens, warmup=len(trace.requests) // 3)
    modes = {r.mode: r.summary() for r in (simulate.per_block(trace, node, **common),
                                           simulate.per_block(trace, node, frequency_filter=False, **common),
                                           simulate.whole_user(trace, node, **common))}
    rate = inputs.fleet_rate() if inputs.trace is None else len(trace.requests) / trace.seconds
    recomputed = modes["per-block"]["recompute_share"] * inputs.k * tokens
    prefill_load = rate * (inputs.question_tokens + recomputed) / node.prefill_tokens_s
    nodes_compute = max(1, math.ceil(prefill_load / inputs.prefill_utilization))
    text_tokens_day = rate * SECONDS_PER_DAY * inputs.k * tokens
    node_corpus = storage[inputs.kv_dtype] / nodes_storage
    return {
        "model": inputs.model.name, "kv_dtype": inputs.kv_dtype, "bytes_per_token": bpt,
        "bytes_per_token_by_dtype": inputs.model.all_bytes_per_token(),
        "bytes_per_token_ratio": {d: s / storage["bf16"] for d, s in storage.items()},
        "users": users, "mean_memories": total_memories / users, "tokens_per_memory": tokens,
        "storage_bytes": storage, "requests_per_s": rate, "k": inputs.k,
        "nodes_by_storage": nodes_storage, "nodes_by_prefill": nodes_compute,
        "nodes": max(nodes_storage, nodes_compute),
        "node": {"users": node_users, "simulated_users": sim_users, "scale": scale,
                 "disk_bytes": node_corpus, "dram_bytes": min(node.dram_bytes, node_corpus),
                 "hbm_bytes": min(node.hbm_bytes, node_corpus),
                 "hbm_blocks": node.hbm_bytes // (tokens * bpt),
                 "hbm_whole_users": node.hbm_bytes / (pop.mean_memories * tokens * bpt)},
        "recompute_as_text_gpu_hours_per_day": text_tokens_day / node.prefill_tokens_s / 3600,
        "modes": modes,
    }


def _si(x: float, unit: str) -> str:
    for prefix, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{x / f:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def table(plan: dict) -> str:
    """The plan as the text tables the command prints."""
    lines = [f"model {plan['model']}, {plan['users']:,} users × {plan['mean_memories']:.0f} memories × "
             f"{plan['tokens_per_memory']} tokens, {plan['requests_per_s']:.2f} requests/s, k = {plan['k']}",
             "", "| kv dtype | bytes/token | × bf16 | storage |", "|---|---|---|---|"]
    for d, s in plan["storage_bytes"].items():
        bpt, ratio = plan["bytes_per_token_by_dtype"][d], plan["bytes_per_token_ratio"][d]
        lines.append(f"| {d} | {bpt:,} | {ratio:.3f} | {_si(s, 'B')} |")
    n = plan["node"]
    lines += ["", f"nodes: {plan['nodes']} ({plan['nodes_by_storage']} by disk, {plan['nodes_by_prefill']} by "
              f"prefill); per node {n['users']:,} users, {_si(n['disk_bytes'], 'B')} on disk, "
              f"{_si(n['dram_bytes'], 'B')} DRAM, {_si(n['hbm_bytes'], 'B')} HBM ({n['hbm_blocks']:,} blocks or "
              f"{n['hbm_whole_users']:.0f} whole users); simulated {n['simulated_users']:,} users "
              f"(budgets × {n['scale']:.3f}); all memories re-prefilled as text: "
              f"{plan['recompute_as_text_gpu_hours_per_day']:.1f} GPU-hours/day",
              "", "| caching | HBM | DRAM | disk | recomputed | MB/request | fetch p50 | fetch p99 | ready p50 |"
              " ready p99 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, m in plan["modes"].items():
        lines.append(f"| {mode} | {m['share_gpu']:.1%} | {m['share_dram']:.1%} | {m['share_disk']:.1%} | "
                     f"{m['share_recomputed']:.1%} | {m['bytes_per_request'] / 1e6:,.1f} | {_ms(m['fetch_p50_s'])} | "
                     f"{_ms(m['fetch_p99_s'])} | {_ms(m['ready_p50_s'])} | {_ms(m['ready_p99_s'])} |")
    return "\n".join(lines)
