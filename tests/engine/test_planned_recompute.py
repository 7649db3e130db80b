"""A kv request whose memories are partly recomputed (``GenRequest.recompute_ids``, the fetch planner's recompute
set): those memories' tokens are prefilled behind the injected blocks, in the prompt pass, as text mode does."""

import pytest

import tiny_models as tm
from inferscale.engine import MemoryItem
from inferscale.engine.loop import DoneEvent, GenRequest
from inferscale.engine.sampling import Sampling
from inferscale.errors import InvalidInputError

ITEMS = [
    MemoryItem("m0", "caroline went to paris in may 2023 with her sister"),
    MemoryItem("m1", "melanie painted the beach and her dog", timestamp="june 2022"),
    MemoryItem("m2", "they went camping with the kids and the cat"),
    MemoryItem("m3", "caroline loves the support group where she reads"),
]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request):
    return tm.engine(request.param, sliding_window=8)


def _run(engine, blocks, mode, recompute=()):
    events = []
    req = GenRequest(ids=engine.question_ids("where did caroline go?"), blocks=blocks, mode=mode,
                     sampling=Sampling(max_new_tokens=6, ignore_eos=True), emit=events.append,
                     recompute_ids=[t for b in recompute for t in b.token_ids], keep_first_logits=True)
    loop = engine.serving_loop()
    loop.add(req)
    loop.run_until_done()
    done = events[-1]
    assert isinstance(done, DoneEvent), done
    return req.first_logits, req.output, done


def test_every_memory_recomputed_is_text_mode(engine):
    blocks = engine.encode(ITEMS, context_tokens=0)  # context-free: kv differs from text, recompute must not
    text_logits, text_out, text_done = _run(engine, blocks, "text")
    kv_logits, _, _ = _run(engine, blocks, "kv")
    logits, out, done = _run(engine, [], "kv", recompute=blocks)
    assert (logits - text_logits).abs().max() < 1e-4 < (kv_logits - text_logits).abs().max()
    assert out == text_out
    assert done.memory_tokens == text_done.memory_tokens == sum(b.num_tokens for b in blocks)
    assert done.prompt_tokens == text_done.prompt_tokens


def test_recomputed_memories_behind_injected_ones_read_like_text(engine):
    """Blocks encoded in order behind full context are exactly text; so is injecting the first two and recomputing
    the last two behind them."""
    blocks = engine.encode(ITEMS)
    text_logits, text_out, _ = _run(engine, blocks, "text")
    logits, out, done = _run(engine, blocks[:2], "kv", recompute=blocks[2:])
    assert (logits - text_logits).abs().max() < 1e-4
    assert out == text_out
    assert done.memory_tokens == sum(b.num_tokens for b in blocks)


def test_recompute_ids_only_in_kv_mode(engine):
    blocks = engine.encode(ITEMS[:1])
    req = GenRequest(ids=engine.question_ids("x"), blocks=blocks, mode="text", sampling=Sampling(),
                     emit=lambda e: None, recompute_ids=list(blocks[0].token_ids))
    with pytest.raises(InvalidInputError, match="recompute"):
        engine.serving_loop().add(req)
