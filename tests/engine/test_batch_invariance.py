"""A request's logits do not depend on which other requests share its passes (the real default model, bf16).

Decode steps and kv questions attend row by row (``kernels/row_attention``): each row reads its own keys, in an order
set by its own length. Before it, SDPA reduced every row over the batch's longest row, padded and masked, in an
order that depends on that length: here 4 of 6 requests got other logits beside one companion than among all six
(first tokens included), and six LoCoMo-like questions decoded alone and together agreed in 3 of 6 (issue 22).

The products follow oneDNN's chain lengths (``kernels/bf16_linear``, bit for bit F.linear for the rows of a
batch); for 2048 in-features (Gemma's down projection) oneDNN adds a single row in chains of 512 and several in
chains of 1024, and the kernel once did too, so a step of ONE row rounded differently from the same row among others
(a greedy answer decoded alone ended "2011." and beside any other request "2012.", 2026-12-06). A lone row now takes
the batch's chains, so each request here is also decoded alone. Skipped where the kernel is not built here (there
attention stays SDPA, which gives no such promise)."""

from __future__ import annotations

import pytest
import torch

from inferscale.engine import Engine, MemoryItem, Sampling
from inferscale.engine.loop import GenRequest
from inferscale.kernels import row_attention

pytestmark = pytest.mark.slow

FACTS = ["Caroline went to an LGBTQ support group on 7 May 2023.", "Melanie painted a lake sunrise last year.",
         "Caroline is moving to Porto in September to study counselling.", "Melanie ran a charity race in June.",
         "Caroline's grandmother gave her a necklace from Sweden.", "Melanie's kids love dinosaurs and the beach."]
QUESTIONS = ["When did Caroline go to the support group?", "What did Melanie paint?", "Where is Caroline moving?",
             "What did Melanie do in June?", "Where is Caroline's necklace from?", "What do Melanie's kids like?"]
TOKENS = 8


@pytest.fixture(scope="module")
def engine():
    if row_attention.load() is None:
        pytest.skip("row_attention.cpp not built here: attention stays SDPA")
    return Engine.load()


def _logits(engine: Engine, cases: list, indices: list[int]) -> dict[int, list[torch.Tensor]]:
    """The logits each of ``cases[i]`` (question ids, blocks) was decoded from, the requests run in one loop. The
    LM head's greedy screen (exact, no logits) is set aside meanwhile."""
    loop = engine.serving_loop()
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in indices}
    index: dict[int, int] = {}
    original = loop._postprocess

    def spy(req, logits, *greedy):
        seen[index[id(req)]].append(logits.clone())
        original(req, logits, *greedy)

    loop._postprocess = spy
    for i in indices:
        q, blocks = cases[i]
        req = GenRequest(ids=q, blocks=blocks, mode="kv", tenant=f"t{i}", emit=lambda e: None,
                         sampling=Sampling(max_new_tokens=TOKENS, ignore_eos=True))
        index[id(req)] = i
        loop.add(req)
    screen, engine.loaded.greedy = engine.loaded.greedy, None
    try:
        loop.run_until_done()
    finally:
        engine.loaded.greedy = screen
    return seen


def test_each_requests_logits_are_the_same_alone_beside_one_request_and_among_all(engine: Engine):
    blocks = engine.encode([MemoryItem(f"m{i}", t) for i, t in enumerate(FACTS)])
    # other memories, so other lengths, per question: the batch pads each row to its longest
    cases = [(engine.question_ids(q), blocks[: 2 + i]) for i, q in enumerate(QUESTIONS)]
    cases.append((engine.question_ids("What is this?"), blocks[:3]))  # the companion
    companion = len(cases) - 1
    together = _logits(engine, cases, list(range(companion)))
    for i in range(companion):
        paired = _logits(engine, cases, [i, companion])[i]
        alone = _logits(engine, cases, [i])[i]
        assert len(paired) == len(alone) == TOKENS
        assert all(torch.equal(a, b) for a, b in zip(paired, together[i], strict=True)), i
        assert all(torch.equal(a, b) for a, b in zip(alone, together[i], strict=True)), i
