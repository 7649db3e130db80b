"""``inferscale demo``: load ~30 sample memories of a fictional user into a running server, then ask one question
with k memories in ``kv`` mode and in ``text`` mode through the official ``openai`` client and print both TTFTs."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from inferscale.errors import ConfigError

SAMPLE = Path(__file__).with_name("sample_memories.jsonl")
QUESTION = "What is the name of Maya's dog?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("INFERSCALE_URL", "http://127.0.0.1:8000"), help="server URL")
    p.add_argument("--api-key", default=os.environ.get("INFERSCALE_API_KEY"),
                   help="tenant API key (INFERSCALE_API_KEY; printed by `inferscale serve` on first start)")
    p.add_argument("--user", default="maya", help="user to load the memories for")
    p.add_argument("--memories", default=str(SAMPLE), help="JSONL of memory items (default: the packaged sample)")
    p.add_argument("--question", default=QUESTION)
    p.add_argument("-k", type=int, default=20, help="memories to retrieve (default 20)")
    p.add_argument("--repeats", type=int, default=3, help="timed requests per mode; the median is reported")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")


def run(args: argparse.Namespace) -> int:
    import httpx
    from openai import APIConnectionError, APIStatusError, OpenAI

    if not args.api_key:
        raise ConfigError("no API key: pass --api-key or set INFERSCALE_API_KEY (printed by `inferscale serve`)")
    items = [json.loads(line) for line in Path(args.memories).read_text().splitlines() if line.strip()]
    base = args.url.rstrip("/")
    client = OpenAI(base_url=base + "/v1", api_key=args.api_key, max_retries=0, timeout=300)
    try:
        model = args.model or client.models.list().data[0].id
    except APIConnectionError:
        raise ConfigError(f"no server at {base}: start one with `inferscale serve`") from None
    except APIStatusError as e:
        raise ConfigError(f"{base}: {e.status_code} {e.message}") from None

    r = httpx.put(f"{base}/v1/memories/{args.user}", json={"items": items, "replace": True},
                  headers={"Authorization": f"Bearer {args.api_key}"}, timeout=600)
    if r.status_code != 200:
        raise ConfigError(f"loading memories: {r.status_code} {r.text}")
    out = r.json()
    print(f"Loaded {out['encoded']} memories for user {args.user!r} (encoded once to KV: {out['bytes'] / 1e6:.1f} MB, "
          f"{out['seconds']:.2f} s)")
    print(f"Question: {args.question}   (k={args.k}, model {model})\n")

    def ask(mode: str):
        raw = client.chat.completions.with_raw_response.create(
            model=model, user=args.user, max_tokens=24, messages=[{"role": "user", "content": args.question}],
            extra_body={"inferscale": {"k": args.k, "mode": mode}})
        return float(raw.headers["x-inferscale-ttft-ms"]), raw.parse()

    for mode in ("kv", "text"):  # warm-up: first-touch costs (caches, allocator) are not the mode's
        ask(mode)
    results = {}
    for mode in ("kv", "text"):
        runs = [ask(mode) for _ in range(max(1, args.repeats))]
        ttft = statistics.median(t for t, _ in runs)
        resp = runs[-1][1]
        ext = resp.model_extra.get("inferscale") or {}
        results[mode] = ttft
        print(f"  {mode:<5} TTFT {ttft:8.1f} ms   prompt tokens {resp.usage.prompt_tokens:5d}   "
              f"memories {len(ext.get('items', []))}   answer: {resp.choices[0].message.content!r}")
    print(f"\nkv is {results['text'] / results['kv']:.1f}x faster to the first token than text "
          f"({results['kv']:.1f} ms vs {results['text']:.1f} ms): only the question is prefilled.")
    return 0
