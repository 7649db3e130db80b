"""``inferscale bench ttft``: time to first token vs k, side by side in one run.

For each k and repeat, the modes run back to back on the same question and memories:
  text     memories pasted into the prompt and prefilled (prefix cached, logits of the last position only)
  kv       blocks already in DRAM, rotated into place; only the question is prefilled
  kv_cold  the same, blobs read from disk first (page cache dropped where the OS allows)
  floor    the question alone over an already-resident cache of the same length: the limit for kv
Medians over repeats, the order of the modes rotating from repeat to repeat; the machine is shared, so compare
ratios within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from inferscale.bench.args import add_model_arguments
from inferscale.bench.progress import progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--k", default="5,10,20,50", help="comma-separated numbers of memories")
    p.add_argument("--memories", default=None, help="JSONL of memories (default: built-in synthetic LoCoMo-like set)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write a PNG of TTFT vs k")


def run(args: argparse.Namespace) -> int:
    from inferscale.bench.synthetic import QUESTIONS, synthetic_memories
    from inferscale.engine import Engine, Sampling, read_jsonl
    from inferscale.engine.cache import injected_cache
    from inferscale.errors import ConfigError
    from inferscale.kvformat import save_block

    ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    if not ks or ks[0] < 1:
        raise ConfigError(f"--k {args.k!r}: expected positive integers")
    if args.random_weights:
        from inferscale.bench.random_model import random_engine

        engine = random_engine(args.random_weights, device=args.device, dtype=args.dtype)
    else:
        engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    items = read_jsonl(args.memories) if args.memories else synthetic_memories(max(ks), engine.tokenizer)
    if len(items) < max(ks):
        raise ConfigError(f"--memories has {len(items)} items, fewer than k={max(ks)}")
    blocks = engine.encode(items[: max(ks)])
    blob_dir = Path(tempfile.mkdtemp(prefix="inferscale-bench-"))
    paths = [save_block(b, blob_dir) for b in blocks]
    cfg, layout = engine.loaded.model.config, engine.loaded.layout
    questions = [engine.question_ids(q) for q in QUESTIONS]

    # text, kv and kv_cold go through the serving loop (Engine.ask), the path the server runs: one token each.
    one_token = Sampling(max_new_tokens=1)

    def t_text(k, q):
        t = time.perf_counter(); engine.ask(q, blocks[:k], "text", sampling=one_token); return time.perf_counter() - t

    def t_kv(k, q):
        t = time.perf_counter(); engine.ask(q, blocks[:k], "kv", sampling=one_token); return time.perf_counter() - t

    def t_cold(k, q):
        for path in paths[:k]:
            _drop_page_cache(path)
        t = time.perf_counter()
        loaded = engine.load_blocks(paths[:k])
        engine.ask(q, loaded, "kv", sampling=one_token)
        return time.perf_counter() - t

    def t_floor(k, q):
        cache = injected_cache(engine.prefix_kv, blocks[:k], layout, cfg)  # resident before the clock starts
        start = len(engine.prefix_ids) + sum(b.num_tokens for b in blocks[:k])
        t = time.perf_counter()
        with torch.inference_mode():
            int(torch.argmax(engine.forward_logits(q, start, cache)))
        return time.perf_counter() - t

    timers = {"text": t_text, "kv": t_kv, "kv_cold": t_cold, "floor": t_floor}
    for name, fn in timers.items():  # warm-up: allocator, kernels, lazy imports
        fn(ks[0], questions[0])
    rows = []
    bar = progress(total=len(ks) * args.repeats * len(timers), desc="bench ttft", unit="prefill")
    for k in ks:
        samples: dict[str, list[float]] = {name: [] for name in timers}
        names = list(timers)
        for r in range(args.repeats):
            q = questions[r % len(questions)]
            # Rotate the order each repeat: a mode timed right after text's long prefill finds cold caches.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                samples[name].append(timers[name](k, q))
                bar.update()
        row = {"k": k, "memory_tokens": sum(b.num_tokens for b in blocks[:k])}
        for name in timers:
            row[f"ttft_{name}_ms"] = round(statistics.median(samples[name]) * 1000, 1)
        rows.append(row)
        bar.clear()
        _print_row(row)
    bar.close()
    result = {
        "model": engine.loaded.name,
        "device": str(engine.device) + ("" if engine.device.type != "cpu" else f" ({platform.processor() or platform.machine()})"),
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "inject": "triton" if engine.device.type == "cuda" and _triton_available() else "torch",
        "repeats": args.repeats,
        "rows": rows,
        "summary": _summary(rows),
    }
    print(json.dumps(result["summary"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        _plot(rows, args.plot, result["model"])
    for p in paths:
        p.unlink(missing_ok=True)
    blob_dir.rmdir()
    return 0


def _triton_available() -> bool:
    from inferscale.kernels.inject import triton_available

    return triton_available()


def _summary(rows: list[dict]) -> dict:
    first, last = rows[0], rows[-1]
    return {
        "k_max": last["k"],
        "text_over_kv": round(last["ttft_text_ms"] / last["ttft_kv_ms"], 2),
        "kv_over_floor": round(last["ttft_kv_ms"] / last["ttft_floor_ms"], 2),
        "kv_growth": round(last["ttft_kv_ms"] / first["ttft_kv_ms"], 2),
    }


_HEADER_PRINTED = False


def _print_row(row: dict) -> None:
    global _HEADER_PRINTED
    if not _HEADER_PRINTED:
        print(f"{'k':>4} {'mem tok':>8} {'text ms':>9} {'kv ms':>8} {'kv cold':>8} {'floor':>8} {'text/kv':>8}")
        _HEADER_PRINTED = True
    print(f"{row['k']:>4} {row['memory_tokens']:>8} {row['ttft_text_ms']:>9.1f} {row['ttft_kv_ms']:>8.1f} "
          f"{row['ttft_kv_cold_ms']:>8.1f} {row['ttft_floor_ms']:>8.1f} {row['ttft_text_ms'] / row['ttft_kv_ms']:>8.1f}")


def _drop_page_cache(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass


def _plot(rows: list[dict], out: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r["k"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("ttft_text_ms", "text (prefill memories)"), ("ttft_kv_cold_ms", "kv, blobs from disk"),
                       ("ttft_kv_ms", "kv, blocks in DRAM"), ("ttft_floor_ms", "floor (question only)")):
        ax.plot(ks, [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("memories injected (k)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT vs k — {model}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
