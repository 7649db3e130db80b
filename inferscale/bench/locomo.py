"""``inferscale bench locomo``: answer quality with memories pasted (text) vs injected (kv, kv-recompute).

Memories are LoCoMo's ``observation`` facts (one item per fact, stamped with its session date), encoded once per
conversation. Each question retrieves its top-k facts once; every mode then answers from the same facts with the
same template, greedily, so the modes differ only in how the memory tokens got their KV. Metrics per mode: token
F1 (LoCoMo's normalisation), agreement with ``text`` (first token, whole answer), KL(text || mode) of the
first-token distributions, TTFT; per k: evidence recall.
``--kv-dtype bf16,int8,...`` runs every KV mode once per storage format (``inferscale.kvquant``): the facts are
encoded once and each format's blocks are those blocks quantized (what ``encode --kv-dtype`` writes); modes
other than bf16 are labelled ``<mode>/<format>`` (``kv/int8``), so each format's cost against ``text`` and
against bf16 blocks reads off one table; compact rows also carry ``kl_vs_bf16`` and ``agree_first_token_bf16``
(against the same mode on bf16 blocks: the cost of the format alone, with retrieval and template held fixed).
The dataset is not shipped: snap-research/LoCoMo, data/locomo10.json (CC BY-NC 4.0).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import string
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from inferscale.bench.progress import progress
from inferscale.contract import DEFAULT_RECOMPUTE_RATIO, MODES
from inferscale.engine.encoder import DEFAULT_CONTEXT_TOKENS
from inferscale.engine.template import MemoryItem
from inferscale.errors import ConfigError

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}  # 5 (adversarial) is excluded


@dataclass
class Fact:
    item: MemoryItem
    dia_id: str


@dataclass
class Question:
    conv: str
    question: str
    answer: str
    category: int
    evidence: list[str]


@dataclass
class Conversation:
    sample_id: str
    facts: list[Fact]
    questions: list[Question]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="LoCoMo JSON (data/locomo10.json of snap-research/LoCoMo)")
    p.add_argument("--conversations", type=int, default=None, help="use the first N conversations (after --skip)")
    p.add_argument("--skip", type=int, default=0, help="skip the first N conversations (hold them out)")
    p.add_argument("--questions-per-conv", type=int, default=20)
    p.add_argument("--k", default="5,20,50")
    p.add_argument("--modes", default="text,kv,kv-recompute",
                   help="text, kv, none, kv-recompute (ratio from --recompute-ratio) or kv-recompute@R")
    p.add_argument("--recompute-ratio", type=float, default=DEFAULT_RECOMPUTE_RATIO)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--context-tokens", type=int, default=DEFAULT_CONTEXT_TOKENS,
                   help="encode each fact behind up to this many tokens of the facts before it (0: the prefix only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-dtype", default="bf16",
                   help="comma list of KV storage formats for the kv modes (bf16, int8, fp8, int4; "
                        "default %(default)s)")


# ---- LoCoMo's answer normalisation and token F1 ---------------------------------------------------------------
def normalize_answer(s: str) -> str:
    s = str(s).replace(",", "").lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the|and)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str, truth: str) -> float:
    from nltk.stem import PorterStemmer

    stem = PorterStemmer().stem
    pred = [stem(w) for w in normalize_answer(prediction).split()]
    gold = [stem(w) for w in normalize_answer(truth).split()]
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


# ---- data ---------------------------------------------------------------------------------------------------
def load_locomo(path: str) -> list[Conversation]:
    try:
        samples = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--data {path}: cannot read LoCoMo JSON ({e})") from None
    out = []
    for sample in samples:
        sid = sample["sample_id"]
        conv = sample.get("conversation", {})
        facts: list[Fact] = []
        for key, by_speaker in sample.get("observation", {}).items():
            m = re.match(r"session_(\d+)_observation", key)
            if not m:
                continue
            date = _session_date(conv.get(f"session_{m.group(1)}_date_time", ""))
            for speaker_facts in by_speaker.values():
                for entry in speaker_facts:
                    text, dia = entry[0], entry[1] if len(entry) > 1 else ""
                    dia = dia[0] if isinstance(dia, list) and dia else dia
                    item = MemoryItem(id=f"{sid}-{len(facts):04d}", text=text, timestamp=date or None)
                    facts.append(Fact(item=item, dia_id=str(dia)))
        questions = [
            Question(sid, qa["question"], str(qa["answer"]), int(qa["category"]), [str(e) for e in qa.get("evidence", [])])
            for qa in sample.get("qa", []) if int(qa.get("category", 5)) in CATEGORIES and "answer" in qa
        ]
        out.append(Conversation(sid, facts, questions))
    return out


def _session_date(stamp: str) -> str:
    """'1:56 pm on 8 May, 2023' → '8 May 2023'."""
    day = stamp.split(" on ", 1)[-1]
    return day.replace(",", "").strip()


def sample_questions(questions: list[Question], n: int, rng: random.Random) -> list[Question]:
    """Seeded sample stratified by category: round-robin over categories, random within each."""
    by_cat: dict[int, list[Question]] = {}
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    for qs in by_cat.values():
        rng.shuffle(qs)
    picked: list[Question] = []
    while len(picked) < n and any(by_cat.values()):
        for cat in sorted(by_cat):
            if by_cat[cat] and len(picked) < n:
                picked.append(by_cat[cat].pop())
    return picked


def parse_modes(spec: str, default_ratio: float) -> list[tuple[str, str, float]]:
    """'text,kv,kv-recompute@0.05' → [(label, engine mode, ratio)]; text always runs first (the reference)."""
    modes = []
    for name in [m.strip() for m in spec.split(",") if m.strip()]:
        base, _, ratio = name.partition("@")
        if base not in MODES:
            raise ConfigError(f"--modes: unknown mode {name!r}")
        r = float(ratio) if ratio else default_ratio
        label = f"kv-recompute@{r:g}" if base == "kv-recompute" else base
        modes.append((label, base, r))
    if not any(m[0] == "text" for m in modes):
        modes.insert(0, ("text", "text", 0.0))
    modes.sort(key=lambda m: m[0] != "text")
    return modes


# ---- run ----------------------------------------------------------------------------------------------------
def with_kv_dtypes(modes: list[tuple[str, str, float]], formats: list[str]) -> list[tuple[str, str, float, str]]:
    """Each mode that injects KV once per format (label ``mode/format`` unless bf16); text and none once."""
    out = []
    for label, mode, ratio in modes:
        if mode in ("text", "none"):
            out.append((label, mode, ratio, "bf16"))
        else:
            out += [(label if f == "bf16" else f"{label}/{f}", mode, ratio, f) for f in formats]
    return out


def ask_with_logits(engine, question: str, blocks, mode: str, sampling, ratio: float):
    """engine.ask through the serving loop, also returning the first-token logits the loop kept (not a second
    prefill, which would double the bench's cost)."""
    ans = engine.ask(question, blocks, mode, sampling=sampling, recompute_ratio=ratio, keep_first_logits=True)
    return ans, ans.first_logits


def kl_divergence(ref_logits: torch.Tensor | None, logits: torch.Tensor | None) -> float | None:
    """KL(ref || other) of the next-token distributions, in nats."""
    if ref_logits is None or logits is None:
        return None
    p, q = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
    return float((p.exp() * (p - q)).sum())


def run(args: argparse.Namespace) -> int:
    from inferscale.engine import Engine, Sampling
    from inferscale.kvformat import compact
    from inferscale.kvquant import parse_kv_dtypes
    from inferscale.retrieval import Embedder, injection_order, top_k

    ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    formats = parse_kv_dtypes(getattr(args, "kv_dtype", "bf16"))
    modes = with_kv_dtypes(parse_modes(args.modes, args.recompute_ratio), formats)
    convs = load_locomo(args.data)[args.skip :]
    if args.conversations:
        convs = convs[: args.conversations]
    if not convs:
        raise ConfigError("no conversations selected")
    engine = Engine.load(args.model, device=args.device, dtype=args.dtype, context_tokens=args.context_tokens)
    embedder = Embedder()
    sampling = Sampling(max_new_tokens=args.max_tokens)
    rng = random.Random(args.seed)
    rows = []
    bar = progress(total=0, desc="bench locomo", unit="answer")
    for conv in convs:
        t0 = time.perf_counter()
        blocks = engine.encode([f.item for f in conv.facts], embed=embedder.embed)
        bar.clear()
        print(f"{conv.sample_id}: {len(blocks)} facts, {sum(b.num_tokens for b in blocks)} tokens encoded in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        ids = [b.item_id for b in blocks]
        by_format = {f: {b.item_id: (b if f == "bf16" else compact(b, f)) for b in blocks} for f in formats}
        by_format.setdefault("bf16", {b.item_id: b for b in blocks})
        dia_of = {f.item.id: f.dia_id for f in conv.facts}
        matrix = torch.stack([b.embedding for b in blocks])
        picked = sample_questions(conv.questions, args.questions_per_conv, rng)
        bar.total += len(picked) * len(ks) * len(modes)
        bar.refresh()
        for q in picked:
            ranked = [i for i, _ in top_k(embedder.embed([q.question])[0], ids, matrix, max(ks))]
            for k in ks:
                order = injection_order(ranked[:k])
                got = {dia_of[i] for i in ranked[:k]}
                recall = (sum(e in got for e in q.evidence) / len(q.evidence)) if q.evidence else None
                ref = ref_logits = None
                on_bf16: dict[str, tuple] = {}  # mode label on bf16 blocks -> (answer, logits)
                for label, mode, ratio, fmt in modes:
                    chosen = [by_format[fmt][i] for i in order]
                    ans, logits = ask_with_logits(engine, q.question, chosen, mode, sampling, ratio)
                    if label == "text":
                        ref, ref_logits = ans, logits
                    kl = kl_divergence(ref_logits, logits)
                    base = label.split("/")[0]
                    if fmt == "bf16":
                        on_bf16[base] = (ans, logits)
                    base_ans, base_logits = on_bf16.get(base, (None, None))
                    bar.update()
                    rows.append({
                        "conv": q.conv, "question": q.question, "gold": q.answer, "category": q.category,
                        "k": k, "mode": label, "answer": ans.text, "f1": round(f1_score(ans.text, q.answer), 4),
                        "ttft_ms": round(ans.ttft_s * 1000, 1), "recall": recall,
                        "agree_first_token": ans.first_token == ref.first_token,
                        "agree_answer": ans.token_ids == ref.token_ids,
                        "memory_tokens": ans.memory_tokens, "kv_dtype": fmt,
                        "kl_first_token": None if kl is None else round(kl, 5),
                    })
                    if fmt != "bf16" and base_ans is not None:
                        kl_b = kl_divergence(base_logits, logits)
                        rows[-1]["kl_vs_bf16"] = None if kl_b is None else round(kl_b, 6)
                        rows[-1]["agree_first_token_bf16"] = ans.first_token == base_ans.first_token
        bar.clear()
        _print_summary(summarize(rows))
    bar.close()
    result = {"model": engine.loaded.name, "dtype": str(engine.loaded.dtype).removeprefix("torch."),
              "context_tokens": engine.context_tokens,
              "conversations": [c.sample_id for c in convs], "seed": args.seed, "ks": ks,
              "modes": [m[0] for m in modes], "kv_dtypes": formats}
    by_k = summarize(rows)
    result["by_k"] = by_k
    result["summary"] = by_k[str(ks[-1])]
    result["rows"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def summarize(rows: list[dict], *, boot: int = 1000) -> dict:
    """{k: {mode: {f1, f1_ratio (paired vs text, with 95% bootstrap CI), agreement, TTFT, recall, by category}}}."""
    out: dict = {}
    rng = random.Random(0)
    for k in sorted({r["k"] for r in rows}):
        at_k = [r for r in rows if r["k"] == k]
        text = {(r["conv"], r["question"]): r for r in at_k if r["mode"] == "text"}
        out[str(k)] = {}
        for mode in dict.fromkeys(r["mode"] for r in at_k):
            rs = [r for r in at_k if r["mode"] == mode]
            ttft = sorted(r["ttft_ms"] for r in rs)
            pairs = [(r["f1"], text[(r["conv"], r["question"])]["f1"]) for r in rs]
            summary = {
                "n": len(rs),
                "f1": round(statistics.mean(r["f1"] for r in rs), 4),
                "agree_first_token": round(statistics.mean(r["agree_first_token"] for r in rs), 4),
                "agree_answer": round(statistics.mean(r["agree_answer"] for r in rs), 4),
                "ttft_p50_ms": round(statistics.median(ttft), 1),
                "ttft_p95_ms": round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 1),
                "f1_ratio": _ratio(pairs),
                "f1_ratio_ci95": _bootstrap_ci(pairs, rng, boot),
                "by_category": {
                    CATEGORIES[c]: round(statistics.mean(r["f1"] for r in rs if r["category"] == c), 4)
                    for c in sorted({r["category"] for r in rs})
                },
            }
            kls = [r["kl_first_token"] for r in rs if r.get("kl_first_token") is not None]
            summary["kl_first_token"] = round(statistics.mean(kls), 5) if kls else None
            summary["kv_dtype"] = rs[0].get("kv_dtype", "bf16")
            vs = [r["kl_vs_bf16"] for r in rs if r.get("kl_vs_bf16") is not None]
            if vs:
                summary["kl_vs_bf16"] = round(statistics.mean(vs), 6)
                summary["agree_first_token_bf16"] = round(
                    statistics.mean(r["agree_first_token_bf16"] for r in rs if "agree_first_token_bf16" in r), 4)
            recalls = [r["recall"] for r in rs if r["recall"] is not None]
            summary["evidence_recall"] = round(statistics.mean(recalls), 4) if recalls else None
            out[str(k)][mode] = summary
    return out


def _ratio(pairs: list[tuple[float, float]]) -> float | None:
    ref = sum(t for _, t in pairs)
    return round(sum(m for m, _ in pairs) / ref, 4) if ref else None


def _bootstrap_ci(pairs, rng: random.Random, n: int) -> list[float] | None:
    """Resample questions (keeping each mode/text pair together): the spread of the F1 ratio."""
    if not pairs or not sum(t for _, t in pairs):
        return None
    stats = []
    for _ in range(n):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        ref = sum(t for _, t in sample)
        if ref:
            stats.append(sum(m for m, _ in sample) / ref)
    stats.sort()
    return [round(stats[int(0.025 * len(stats))], 3), round(stats[int(0.975 * len(stats)) - 1], 3)]


def _print_summary(by_k: dict) -> None:
    print(f"{'k':>3} {'mode':<20} {'n':>4} {'F1':>6} {'F1/text':>8} {'95% CI':>14} {'1st tok':>8} {'answer':>7} "
          f"{'KL':>7} {'TTFT p50':>9} {'recall':>7} {'KL/bf16':>8} {'1st/bf16':>8}")
    for k, modes in by_k.items():
        for mode, s in modes.items():
            ci = s["f1_ratio_ci95"]
            print(f"{k:>3} {mode:<20} {s['n']:>4} {s['f1']:>6.3f} {s['f1_ratio'] or 0:>8.3f} "
                  f"{(f'{ci[0]:.2f}-{ci[1]:.2f}' if ci else '-'):>14} {s['agree_first_token']:>8.2f} "
                  f"{s['agree_answer']:>7.2f} {s.get('kl_first_token') or 0:>7.4f} {s['ttft_p50_ms']:>9.1f} {s['evidence_recall'] or 0:>7.2f} "
                  f"{_opt(s.get('kl_vs_bf16'), '.5f'):>8} {_opt(s.get('agree_first_token_bf16'), '.2f'):>8}", flush=True)


def _opt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
