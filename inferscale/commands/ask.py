"""``inferscale ask QUESTION --blobs DIR``: answer with memories injected (or pasted, to compare)."""

from __future__ import annotations

import argparse
import json
import time

from inferscale.contract import DEFAULT_RECOMPUTE_RATIO, MODES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("question")
    p.add_argument("--blobs", required=True, help="directory of KV blobs (from `inferscale encode`)")
    p.add_argument("--mode", choices=MODES, default="kv")
    p.add_argument("--k", type=int, default=None, help="use the k most relevant memories (default: all)")
    p.add_argument("--recompute-ratio", type=float, default=DEFAULT_RECOMPUTE_RATIO, help="kv-recompute: fraction of memory tokens")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from inferscale.engine import Engine, Sampling

    engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    t0 = time.perf_counter()
    blocks = engine.load_blocks(args.blobs)
    load_s = time.perf_counter() - t0
    if args.k is not None and args.k < len(blocks):
        blocks = _top_k(args.question, blocks, args.k)
    answer = engine.ask(
        args.question, blocks, args.mode, sampling=Sampling(max_new_tokens=args.max_tokens),
        recompute_ratio=args.recompute_ratio,
    )
    if args.json:
        print(json.dumps({"answer": answer.text, "mode": args.mode, "ttft_ms": round(answer.ttft_s * 1000, 1),
                          "load_ms": round(load_s * 1000, 1), "memories": len(blocks),
                          "memory_tokens": answer.memory_tokens}))
    else:
        print(answer.text)
        print(f"[{args.mode}] TTFT {answer.ttft_s * 1000:.0f} ms (+ {load_s * 1000:.0f} ms loading {len(blocks)} blobs)"
              f", {answer.memory_tokens} memory tokens")
    return 0


def _top_k(question: str, blocks: list, k: int) -> list:
    from inferscale.retrieval import Embedder, injection_order, top_k

    with_emb = [b for b in blocks if b.embedding is not None]
    if len(with_emb) < len(blocks):
        return blocks[:k]  # blobs encoded without --embed: no ranking possible, keep file order
    import torch

    by_id = {b.item_id: b for b in blocks}
    ranked = top_k(Embedder().embed([question])[0], list(by_id), torch.stack([b.embedding for b in blocks]), k)
    return [by_id[item_id] for item_id in injection_order([item_id for item_id, _score in ranked])]
