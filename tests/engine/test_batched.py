"""Batched decode and chunked prefill compute what one sequence at a time computes.

Each request in a batch has its own injected prefix and blocks and its own length; sliding-window layers (window
8, far shorter than the prompts) must see exactly their window. Reference: ``Engine.prefill`` + ``Engine.step``
(one sequence, a DynamicCache that trims sliding layers as the model does)."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from inferscale.engine import MemoryItem, Sampling
from inferscale.engine.loop import DoneEvent, GenRequest, ServingLoop, TokenEvent
from inferscale.engine.scheduler import SchedulerConfig

ITEMS = [
    MemoryItem("m0", "caroline went to paris in may 2023 with her sister"),
    MemoryItem("m1", "melanie painted the beach and her dog", timestamp="june 2022"),
    MemoryItem("m2", "they went camping with the kids and the cat"),
    MemoryItem("m3", "caroline loves the support group where she reads"),
]
QUESTIONS = ["where did caroline go?", "what did melanie paint at the beach in june?", "who?"]
STEPS = 6


def reference_logits(engine, q, blocks, mode) -> list[torch.Tensor]:
    """Greedy decode one sequence at a time; the logits before each of STEPS tokens."""
    seq = engine.prefill(q, blocks, mode)
    out = [seq.logits.clone()]
    for _ in range(STEPS - 1):
        engine.step(seq, int(seq.logits.argmax()))
        out.append(seq.logits.clone())
    return out


def loop_logits(loop: ServingLoop, requests: list[GenRequest]) -> dict[int, list[torch.Tensor]]:
    """Run the requests together; record the logits each one's tokens were sampled from (the full head's: the LM
    head's greedy screen, which computes no logits, is set aside meanwhile)."""
    seen: dict[int, list[torch.Tensor]] = {id(r): [] for r in requests}
    original = loop._postprocess
    screen, loop.engine.loaded.greedy = loop.engine.loaded.greedy, None

    def spy(req, logits, *greedy):
        seen[id(req)].append(logits.float().clone())
        original(req, logits, *greedy)

    loop._postprocess = spy
    for r in requests:
        loop.add(r)
    loop.run_until_done()
    loop.engine.loaded.greedy = screen
    return seen


def request(engine, q, blocks, mode, events=None) -> GenRequest:
    sink = events.append if events is not None else (lambda e: None)
    return GenRequest(ids=q, blocks=blocks, mode=mode, sampling=Sampling(max_new_tokens=STEPS, ignore_eos=True),
                      emit=sink)


@pytest.fixture(scope="module", params=tm.FAMILIES)
def engine(request):
    return tm.engine(request.param, sliding_window=8)


@pytest.mark.parametrize("mode", ["kv", "text"])
def test_batched_logits_equal_one_at_a_time(engine, mode):
    blocks = engine.encode(ITEMS)
    # Different questions, different blocks (and so different injected lengths) per sequence.
    cases = [(engine.question_ids(QUESTIONS[0]), blocks[:1]), (engine.question_ids(QUESTIONS[1]), blocks[1:4]),
             (engine.question_ids(QUESTIONS[2]), [blocks[3], blocks[0]])]
    loop = ServingLoop(engine, SchedulerConfig(chunk_tokens=7, step_tokens=64))
    reqs = [request(engine, q, b, mode) for q, b in cases]
    got = loop_logits(loop, reqs)
    for (q, b), r in zip(cases, reqs):
        want = reference_logits(engine, q, b, mode)
        assert len(got[id(r)]) == STEPS
        for a, w in zip(got[id(r)], want):
            assert (a - w).abs().max() < 1e-4
    assert loop.rows == [] and loop.decoding == 0  # every slot freed


def test_chunked_text_prefill_between_decodes_gives_the_same_tokens(engine):
    blocks = engine.encode(ITEMS)
    long_q = engine.question_ids(QUESTIONS[1])

    def tokens(chunk: int) -> list[int]:
        loop = ServingLoop(engine, SchedulerConfig(chunk_tokens=chunk, step_tokens=chunk + 8))
        short_events, long_events = [], []
        loop.add(request(engine, engine.question_ids(QUESTIONS[0]), blocks[:1], "kv", short_events))
        loop.step()  # the short one is decoding when the long text prefill arrives
        loop.add(request(engine, long_q, blocks, "text", long_events))
        loop.run_until_done()
        assert isinstance(long_events[-1], DoneEvent)
        return [e.token_id for e in long_events if isinstance(e, TokenEvent)]

    whole = tokens(4096)
    assert tokens(5) == whole
    loop = ServingLoop(engine, SchedulerConfig(chunk_tokens=5, step_tokens=13))
    loop.add(request(engine, long_q, blocks, "text"))
    loop.run_until_done()
    assert loop.steps > 10  # it really was prefilled in chunks


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kv", "text"])
def test_batched_logits_equal_one_at_a_time_gemma(mode):
    from inferscale.engine import Engine

    gemma = Engine.load("gemma-3-270m", dtype="float32")
    items = [MemoryItem(f"m{i}", t) for i, t in enumerate([
        "Caroline went to an LGBTQ support group on 7 May 2023.",
        "Melanie painted a lake sunrise last year.",
        "Caroline is moving to Porto in September to study counselling.",
    ])]
    blocks = gemma.encode(items)
    cases = [(gemma.question_ids("When did Caroline go to the support group?"), blocks[:1]),
             (gemma.question_ids("What did Melanie paint?"), blocks),
             (gemma.question_ids("Where is Caroline moving?"), blocks[1:])]
    loop = ServingLoop(gemma, SchedulerConfig(chunk_tokens=16))
    reqs = [request(gemma, q, b, mode) for q, b in cases]
    got = loop_logits(loop, reqs)
    for (q, b), r in zip(cases, reqs):
        for a, w in zip(got[id(r)], reference_logits(gemma, q, b, mode)):
            assert (a - w).abs().max() < 1e-4


@pytest.mark.parametrize("mode", ["kv", "text"])
def test_ragged_prompt_chunks_in_one_padded_pass_give_each_its_own_logits(engine, mode, monkeypatch):
    """Every step's chunks in one pass whatever their padding: each row's logits are taken at its own last real
    token, and the padding's K/V (past the row's length) never reaches a real token."""
    from inferscale.engine import loop as loop_mod
    from inferscale.engine.promptbatch import padded_groups

    monkeypatch.setattr(loop_mod, "padded_groups", lambda lengths, **_: padded_groups(lengths, max_padding=1.0))
    blocks = engine.encode(ITEMS)
    cases = [(engine.question_ids(QUESTIONS[0]), blocks[:1]), (engine.question_ids(QUESTIONS[1]), blocks[1:4]),
             (engine.question_ids(QUESTIONS[2]), [blocks[3], blocks[0]])]
    loop = ServingLoop(engine, SchedulerConfig(chunk_tokens=11, step_tokens=64))
    passes = []
    real = loop._last_rows

    def forward(rows, starts, ids, last=None):
        if last is not None:
            passes.append(sorted(last))
        return real(rows, starts, ids, last)

    loop._last_rows = forward
    reqs = [request(engine, q, b, mode) for q, b in cases]
    got = loop_logits(loop, reqs)
    assert any(len(set(p)) > 1 for p in passes)  # some pass did hold chunks of different lengths
    for (q, b), r in zip(cases, reqs):
        for a, w in zip(got[id(r)], reference_logits(engine, q, b, mode), strict=True):
            assert (a - w).abs().max() < 1e-4
    assert loop.rows == [] and loop.decoding == 0
