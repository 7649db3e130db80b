"""``inferscale bench step``: the engine's decode step alone, in this process, at N rows against one (issue 22).

``bench load`` reads the decode step through the server, whose clients and event loop share the machine's cores
with the engine; this reads the same step with neither: the serving loop of ``Engine.serving_loop`` driven
directly, N kv requests (each with ``-k`` of 2k synthetic memories, a window of its own) forced to ``--tokens``
tokens. A step counts while all N decode and nothing waits (the steady state). Each repeat reads the floor
(``floor.decode_floor``) and then every N in turn, so a ratio compares steps minutes apart at most. The gap between
the two benches' ratios is what serving costs; this one's ratio is what the engine's kernels allow on this machine.
``--profile`` adds, for the last repeat, each operator's time per steady step (torch's profiler), the largest first.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from inferscale.bench.repeats import print_spread, spread
from inferscale.engine.threads import usable_cores
from inferscale.errors import ConfigError

QUESTION = "What did the user say about the weekend trip and the dog?"
PROFILED_STEPS = 20  # steady steps the profiler covers (fewer where the run has fewer)
TOP_OPS = 8  # operators listed per N; the rest summed as "other"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name or path (default: embedded gemma-3-270m)")
    p.add_argument("--n", default="1,16", help="comma-separated rows per decode step (requests decoding together)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (forced with ignore_eos)")
    p.add_argument("-k", type=int, default=20, help="memories each request attends to (kv, injected)")
    p.add_argument("--repeats", type=int, default=3, help="run every measurement this many times (medians)")
    p.add_argument("--profile", action="store_true", help="also time each operator per step in the last repeat")
    p.add_argument("--json", help="write results here")


def run(args: argparse.Namespace) -> int:
    import torch

    from inferscale.bench.floor import decode_floor
    from inferscale.bench.synthetic import synthetic_memories
    from inferscale.engine import Engine

    ns = sorted({int(n) for n in args.n.split(",") if n.strip()})
    if not ns or ns[0] < 1:
        raise ConfigError(f"--n {args.n!r}: expected positive integers")
    for flag, value, least in (("--tokens", args.tokens, 3), ("-k", args.k, 0), ("--repeats", args.repeats, 1)):
        if value < least:
            raise ConfigError(f"{flag} {value}: must be {least} or more")
    engine = Engine.load(args.model)
    blocks = engine.encode(synthetic_memories(max(1, 2 * args.k), engine.tokenizer, seed=1)) if args.k else []
    bench = StepBench(engine, blocks, args.k, args.tokens)
    repeats = []
    for rep in range(args.repeats):
        floor = decode_floor(engine.loaded.model, torch.get_num_threads())
        profile = args.profile and rep == args.repeats - 1
        repeats.append({"floor": floor, "rows": [bench.measure(n, profile) for n in ns]})
    summaries = [_summary(r["floor"], r["rows"]) for r in repeats]
    result = {"model": engine.loaded.name, "cores": usable_cores(), "torch_threads": torch.get_num_threads(),
              "platform": platform.platform(), "tokens": args.tokens, "k": args.k, "repeats": repeats,
              "summary": spread(summaries)}
    for rep in repeats:
        _print(result, rep)
    _print_summary(result["summary"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


class StepBench:
    """N requests through the engine's serving loop at a time; the steady steps' times (and operators)."""

    def __init__(self, engine, blocks: list, k: int, tokens: int) -> None:
        from inferscale.engine.loop import GenRequest
        from inferscale.engine.sampling import Sampling

        self.loop = engine.serving_loop()
        self.question = engine.question_ids(QUESTION)
        self.request: Callable[[int], GenRequest] = lambda i: GenRequest(
            ids=list(self.question), blocks=blocks[i % k: i % k + k] if k else [], mode="kv",
            sampling=Sampling(max_new_tokens=tokens, ignore_eos=True, stop=()), emit=lambda _event: None)
        self.measure(1, False)  # warm-up: first calls' allocations and packings

    def measure(self, n: int, profile: bool) -> dict:
        """One run of ``n`` requests: the median steady step (and min, max, count); with ``profile``, the
        operators of up to PROFILED_STEPS steady steps."""
        from torch.profiler import profile as torch_profile

        for i in range(n):
            self.loop.add(self.request(i))
        times: list[float] = []
        prof = torch_profile() if profile else None
        profiled, running = 0, False
        while self.loop.has_work():
            steady = self._steady(n)
            if prof is not None and steady and not running and profiled < PROFILED_STEPS:
                prof.start()
                running = True
            elif running and not steady:
                prof.stop()
                running = False
            t0 = time.perf_counter()
            self.loop.step()
            elapsed = time.perf_counter() - t0
            if steady and self._steady(n):
                times.append(elapsed)
                profiled += running
                if running and profiled == PROFILED_STEPS:
                    prof.stop()
                    running = False
        if running:
            prof.stop()
        if not times:
            raise ConfigError(f"no step decoded all {n} rows together: raise --tokens")
        row = {"n": n, "steady_steps": len(times), "step_ms": statistics.median(times) * 1e3,
               "step_min_ms": min(times) * 1e3, "step_max_ms": max(times) * 1e3,
               "tokens_per_s": n / statistics.median(times)}
        if prof is not None and profiled:
            row["operators"] = _operators(prof, profiled)
        return row

    def _steady(self, n: int) -> bool:
        return self.loop.decoding == n and not self.loop.scheduler.num_waiting


def _operators(prof, steps: int) -> list[dict]:
    """The profiled operators' own CPU time per step, the largest first; past TOP_OPS one "other" row."""
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [{"name": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
            for e in ops[:TOP_OPS]]
    rest = ops[TOP_OPS:]
    if rest:
        rows.append({"name": "other", "ms_per_step": sum(e.self_cpu_time_total for e in rest) / 1e3 / steps,
                     "calls_per_step": sum(e.count for e in rest) / steps})
    return rows


def _summary(floor: dict, rows: list[dict]) -> dict:
    """One repeat's floor, single-row step against it and each N's tokens/s against one row's."""
    out = {"floor_ms": floor["floor_ms"]}
    one = next((r for r in rows if r["n"] == 1), None)
    for r in rows:
        out[f"step_ms_{r['n']}"] = r["step_ms"]
    if one is not None:
        out["step_over_floor"] = one["step_ms"] / floor["floor_ms"]
        for r in rows:
            if r["n"] > 1:
                out[f"tokens_per_s_{r['n']}_over_1"] = r["tokens_per_s"] / one["tokens_per_s"]
    return out


def _print(result: dict, rep: dict) -> None:
    fl = rep["floor"]
    print(f"bench step: {result['model']}, the engine alone (no server, no client), k={result['k']}, "
          f"{result['tokens']} tokens a request; decode floor {fl['floor_ms']:.1f} ms "
          f"({fl['weight_bytes'] / 1e9:.3f} GB of weights at {fl['read_gb_per_s']:.1f} GB/s, {fl['floor_threads']} "
          f"threads; the engine decodes on {fl['torch_threads']})")
    print(f"{'N':>3} {'step p50':>9} {'min':>8} {'max':>8} {'steps':>6} {'tok/s':>8}  (ms)")
    for r in rep["rows"]:
        print(f"{r['n']:>3} {r['step_ms']:>9.2f} {r['step_min_ms']:>8.2f} {r['step_max_ms']:>8.2f} "
              f"{r['steady_steps']:>6} {r['tokens_per_s']:>8.1f}")
        for op in r.get("operators", []):
            print(f"      {op['ms_per_step']:7.2f} ms/step {op['calls_per_step']:7.1f} calls  {op['name']}")


def _print_summary(summary: dict) -> None:
    print_spread(summary, 24)
    for key, v in summary.items():
        if key.startswith("tokens_per_s_"):
            n = key.removeprefix("tokens_per_s_").removesuffix("_over_1")
            print(f"engine alone: decode tokens/s, {n} rows / 1 row = {v['median']:.2f}x (issue 22's bar, >= 8x, "
                  f"is read through the server: bench load)")
