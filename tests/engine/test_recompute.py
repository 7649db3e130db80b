"""kv-recompute: r=0 is kv, r=1 is text, and a fraction in between moves kv toward text."""

import pytest
import torch

import tiny_models as tm
from inferscale.engine import MemoryItem
from inferscale.errors import InvalidInputError

ITEMS = [
    MemoryItem("m0", "caroline went to paris in may 2023 with her sister"),
    MemoryItem("m1", "melanie painted the beach and her dog", timestamp="june 2022"),
    MemoryItem("m2", "they went camping with the kids and the cat"),
    MemoryItem("m3", "caroline loves the support group where she reads"),
]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def engine(request):
    return tm.engine(request.param, sliding_window=8)


def test_ratio_zero_is_kv_and_one_is_text(engine):
    blocks = engine.encode(ITEMS, context_tokens=0)  # context-free blocks: kv differs from text
    q = engine.question_ids("where did caroline go?")
    text, kv = engine.prefill(q, blocks, "text"), engine.prefill(q, blocks, "kv")
    r0 = engine.prefill(q, blocks, "kv-recompute", recompute_ratio=0.0)
    r1 = engine.prefill(q, blocks, "kv-recompute", recompute_ratio=1.0)
    assert (r0.logits - kv.logits).abs().max() < 1e-4
    assert (r1.logits - text.logits).abs().max() < 1e-4
    assert r1.cache.get_seq_length() == text.cache.get_seq_length() == r1.length
    for _ in range(3):  # the repaired cache keeps decoding like text
        tok = int(text.logits.argmax())
        engine.step(text, tok)
        engine.step(r1, tok)
        assert (r1.logits - text.logits).abs().max() < 1e-4


def test_partial_recompute_moves_toward_text():
    engine = tm.engine("gemma3", sliding_window=512)
    blocks = engine.encode(ITEMS, context_tokens=0)  # context-free blocks: kv differs from text
    q = engine.question_ids("where did caroline go?")
    text = engine.prefill(q, blocks, "text").logits
    err = {r: float((engine.prefill(q, blocks, "kv-recompute", recompute_ratio=r).logits - text).abs().max())
           for r in (0.0, 0.5, 1.0)}
    assert err[1.0] < 1e-4 < err[0.0]
    assert err[0.5] < err[0.0]


def test_bad_ratio():
    engine = tm.engine("llama")
    blocks = engine.encode(ITEMS[:1])
    with pytest.raises(InvalidInputError, match="recompute ratio"):
        engine.prefill(engine.question_ids("x"), blocks, "kv-recompute", recompute_ratio=1.5)


def test_attention_scores_are_the_questions_attention_and_leave_the_cache(engine):
    """Scores from the injected cache equal the question's attention in a plain forward of the whole text (blocks
    encoded in order with full context are exactly text); the cache and the attention implementation are as before."""
    from inferscale.engine.cache import injected_cache, kv_of_cache
    from inferscale.engine.recompute import attention_scores

    model = engine.loaded.model
    blocks = engine.encode(ITEMS, context_tokens=10_000)
    q = engine.question_ids("where did caroline go?")
    p = len(engine.prefix_ids)
    n = p + sum(b.num_tokens for b in blocks)
    cache = injected_cache(engine.prefix_kv, blocks, engine.loaded.layout, model.config, windowed=False)
    before, impl = kv_of_cache(cache).clone(), model.config._attn_implementation
    scores = attention_scores(engine, cache, p, n, q)
    assert model.config._attn_implementation == impl
    assert torch.equal(kv_of_cache(cache), before)

    ids = engine.prefix_ids + [t for b in blocks for t in b.token_ids] + q
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model.model(input_ids=torch.tensor([ids]), output_attentions=True)
    finally:
        model.set_attn_implementation(impl)
    want = torch.stack([a[0, :, n:, p:n].float().amax(dim=(0, 1)) for a in out.attentions]).sum(dim=0)
    assert scores.shape == (n - p,) and torch.allclose(scores, want, atol=1e-4)
