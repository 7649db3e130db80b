"""``inferscale bench fleet``: TTFT of the fleet's cold path vs a DRAM hit vs text, side by side in one run.

For each k and repeat, on the same question and memories:
  peer   this pod holds nothing of the user: the fleet path (inferscale/store/fleet.py) asks a peer PROCESS for the user's
         index (op ``index``), leases exactly the k blocks over NIXL UCX (real agents on loopback), verifies and
         caches them, then the engine answers (injected KV); the clock covers all of it
  dram   the same k blocks already in this pod's DRAM (``get_many``), then the engine answers
  text   the memories pasted into the prompt and prefilled
Medians over repeats; the machine may be shared, so compare within a run. ``bytes_pulled`` is what one cold
request moved. Bar (issue 13): peer at k=20 <= 2x dram and <= 0.5x text.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import torch

from inferscale.bench.args import add_model_arguments

TENANT, USER = "bench", "fleet-user"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--k", default="5,20,50", help="comma-separated numbers of memories")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write results here")


def run(args: argparse.Namespace) -> int:
    from inferscale.bench.synthetic import QUESTIONS, synthetic_memories
    from inferscale.engine import Engine, Sampling
    from inferscale.errors import ConfigError
    from inferscale.store.fleet import Fleet
    from inferscale.store import KVStore
    from inferscale.bench.node import child_process, serve_node

    ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    if not ks or ks[0] < 1 or args.repeats < 1:
        raise ConfigError(f"--k {args.k!r} / --repeats {args.repeats}: expected positive integers")
    if args.random_weights:
        from inferscale.bench.random_model import random_engine

        engine = random_engine(args.random_weights, device=args.device, dtype=args.dtype)
    else:
        engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    items = synthetic_memories(max(ks), engine.tokenizer)[: max(ks)]
    gen = torch.Generator().manual_seed(0)
    blocks = engine.encode(items)
    for b in blocks:  # retrieval is not what is timed: any embedding makes an index
        b.embedding = torch.randn(32, generator=gen)
    fp = engine.loaded.fingerprint
    questions = [engine.question_ids(q) for q in QUESTIONS]
    one_token = Sampling(max_new_tokens=1)
    budget = 2 * sum(b.nbytes for b in blocks) + (64 << 20)

    with tempfile.TemporaryDirectory(prefix="inferscale-bench-fleet-") as tmp:
        peer_root = Path(tmp) / "peer"
        with KVStore(peer_root, dram_budget_bytes=budget, nixl=False) as s:
            for b in blocks:
                s.put(TENANT, USER, b)
        secret = secrets.token_hex(16)  # this run's INFERSCALE_PEER_SECRET
        options = {"dram_budget_bytes": budget, "timeout_s": 30.0, "preload": [(TENANT, USER, fp)],
                   "peer_secret": secret}
        with child_process(serve_node, str(peer_root), options) as info, \
                KVStore(Path(tmp) / "local", dram_budget_bytes=budget, timeout_s=30.0, peer_secret=secret) as local:
            fleet = Fleet(local)
            fleet.set_peers([info["peer"]])
            ids_all = [b.item_id for b in blocks]
            pulled: dict[int, int] = {}

            def t_peer(k: int, q: list[int]) -> float:
                local.purge(TENANT, USER, None)
                fleet.forget(TENANT, USER)
                t = time.perf_counter()
                fleet.embeddings(TENANT, USER, fp)  # the holder's index: what retrieval ranks
                got = fleet.blocks(TENANT, USER, ids_all[:k], fp)
                engine.ask(q, got.blocks, "kv", sampling=one_token)
                dt = time.perf_counter() - t
                pulled[k] = got.pulled_bytes
                return dt

            def t_dram(k: int, q: list[int]) -> float:
                local_blocks = fleet.blocks(TENANT, USER, ids_all[:k], fp)  # resident before the clock starts
                del local_blocks
                t = time.perf_counter()
                got, _ = local.get_many(TENANT, USER, ids_all[:k], fp)
                engine.ask(q, got, "kv", sampling=one_token)
                return time.perf_counter() - t

            def t_text(k: int, q: list[int]) -> float:
                t = time.perf_counter()
                engine.ask(q, blocks[:k], "text", sampling=one_token)
                return time.perf_counter() - t

            timers = {"peer": t_peer, "dram": t_dram, "text": t_text}
            for fn in timers.values():  # warm-up: allocator, kernels, lazy imports, the NIXL connection
                fn(ks[0], questions[0])
            rows = []
            for k in ks:
                samples: dict[str, list[float]] = {n: [] for n in timers}
                names = list(timers)
                for r in range(args.repeats):
                    q = questions[r % len(questions)]
                    for name in names[r % len(names):] + names[: r % len(names)]:
                        samples[name].append(timers[name](k, q))
                row = {"k": k, "memory_tokens": sum(b.num_tokens for b in blocks[:k]),
                       **{f"ttft_{n}_ms": round(statistics.median(v) * 1000, 2) for n, v in samples.items()},
                       "bytes_pulled": pulled[k]}
                rows.append(row)
                print(f"k={k:>3} peer {row['ttft_peer_ms']:>8.1f} ms  dram {row['ttft_dram_ms']:>8.1f} ms  "
                      f"text {row['ttft_text_ms']:>8.1f} ms  pulled {row['bytes_pulled']} B")
    result = {"model": engine.loaded.name, "device": str(engine.device), "repeats": args.repeats,
              "threads": torch.get_num_threads(), "rows": rows, "bar": _bar(rows)}
    print(json.dumps(result["bar"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _bar(rows: list[dict]) -> dict:
    """Issue 13's bar at k=20 (or the nearest k run): peer <= 2x dram and <= 0.5x text."""
    row = min(rows, key=lambda r: abs(r["k"] - 20))
    return {"k": row["k"], "peer_over_dram": round(row["ttft_peer_ms"] / row["ttft_dram_ms"], 2),
            "peer_over_text": round(row["ttft_peer_ms"] / row["ttft_text_ms"], 2)}
