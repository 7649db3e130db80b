"""``inferscale encode ITEMS.jsonl --out DIR``: memories → one KV blob per item (atomic writes)."""

from __future__ import annotations

import argparse
from pathlib import Path

from inferscale.errors import MemoryItemError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="JSONL, one {id, text, timestamp?} object a line")
    p.add_argument("--out", required=True, help="directory for the blobs (<id>.safetensors)")
    p.add_argument("--model", default=None, help="model name or path (default: the embedded gemma-3-270m)")
    p.add_argument("--only", default=None, help="comma-separated ids: encode just these (the changed items)")
    p.add_argument("--embed", action="store_true", help="also store each item's retrieval embedding")
    p.add_argument("--batch-tokens", type=int, default=1024, help="tokens packed into one forward pass")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from inferscale.engine import Engine, read_jsonl
    from inferscale.kvformat import save_block

    items = read_jsonl(args.input)
    if args.only:
        wanted = [s for s in args.only.split(",") if s]
        known = {i.id for i in items}
        missing = [s for s in wanted if s not in known]
        if missing:
            raise MemoryItemError(f"--only names ids not in {args.input}: {', '.join(missing)}")
        items = [i for i in items if i.id in set(wanted)]
    engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    embed = None
    if args.embed:
        from inferscale.retrieval import Embedder

        embed = Embedder().embed
    # encode() checks every item before any work and blobs are written only after all encoded: a bad item
    # leaves the directory untouched.
    out = Path(args.out)
    with tqdm(total=len(items), unit="item", desc="encoding") as bar:
        blocks = engine.encode(items, batch_tokens=args.batch_tokens, on_progress=bar.update, embed=embed)
    for block in blocks:
        save_block(block, out)
    tokens = sum(b.num_tokens for b in blocks)
    print(f"encoded {len(blocks)} items ({tokens} tokens, {sum(b.nbytes for b in blocks)} bytes) into {out}")
    return 0
