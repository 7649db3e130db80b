"""What ``scripts/aiperf.sh`` stores and asks: the PUT body of the memories its user holds (``memories.json``) and,
unless aiperf makes its prompts up, the questions it sends (``questions.jsonl``, aiperf's ``single_turn`` input file:
one ``{"text": ...}`` a line, empty when aiperf's synthetic prompts are used).

- default: ``k`` of the built-in synthetic memories, dated, as ``bench ttft`` and ``bench load`` store them;
- ``--prompts bench``: ``bench load``'s own question, so that both clients' TTFTs are taken on equal requests;
- ``--locomo FILE``: the first LoCoMo conversation's observations, dated, and its questions (the product's own
  workload: retrieval picks ``k`` of a few hundred real memories for a real question).

``python -m inferscale.bench.aiperfinputs --tokenizer DIR --k 20 [--prompts bench] [--locomo FILE] OUT_DIR``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from inferscale.bench.synthetic import put_body, synthetic_memories
from inferscale.engine.template import MemoryItem


def inputs(tokenizer_dir: str, k: int, prompts: str, locomo: str | None) -> tuple[list[MemoryItem], list[str]]:
    """The memories to store and the questions to ask (none: aiperf's synthetic prompts)."""
    questions: list[str] = []
    if locomo:
        from inferscale.bench.locomo import load_locomo

        conversation = load_locomo(locomo)[0]
        items, questions = [f.item for f in conversation.facts], [q.question for q in conversation.questions]
    else:
        from transformers import AutoTokenizer

        items = synthetic_memories(k, AutoTokenizer.from_pretrained(tokenizer_dir))
    if prompts == "bench":
        from inferscale.bench.loadclients import QUESTION

        questions = [QUESTION]
    return items, questions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inferscale.bench.aiperfinputs", description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="the model's tokenizer directory (sizes the synthetic set)")
    p.add_argument("--k", type=int, default=20, help="how many synthetic memories (with --locomo: all of them)")
    p.add_argument("--prompts", choices=("synthetic", "bench"), default="synthetic")
    p.add_argument("--locomo", default=None, help="a LoCoMo JSON (data/locomo10.json of snap-research/LoCoMo)")
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    items, questions = inputs(args.tokenizer, args.k, args.prompts, args.locomo)
    (args.out / "memories.json").write_text(json.dumps(put_body(items)))
    (args.out / "questions.jsonl").write_text("".join(json.dumps({"text": q}) + "\n" for q in questions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
