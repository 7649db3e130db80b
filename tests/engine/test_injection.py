"""Injected KV must reproduce what the model computes from text, on every supported family."""

import pytest
import torch

import tiny_models as tm
from inferscale.engine import MemoryItem
from inferscale.engine.cache import inject_into_slot, injected_cache, injected_groups, kv_of_cache
from inferscale.engine.slots import SlotCache
from inferscale.kernels import rotate_place
from inferscale.kernels.rope import rope_shift

ITEMS = [
    MemoryItem("m0", "caroline went to paris in may 2023 with her sister"),
    MemoryItem("m1", "melanie painted the beach and her dog", timestamp="june 2022"),
    MemoryItem("m2", "they went camping with the kids and the cat"),
    MemoryItem("m3", "caroline loves the support group where she reads"),
]


@pytest.fixture(scope="module", params=tm.FAMILIES)
def engine(request):
    # A window of 8 is far shorter than the prompts, so sliding layers must trim exactly as the model does.
    return tm.engine(request.param, sliding_window=8)


def _encode_at(engine, item, offset):
    """Reference: prefix + item run as one sequence at positions offset.., keys of the item's tokens."""
    ids = engine.prefix_ids + engine.item_token_ids(item)
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        engine.loaded.model.model(
            input_ids=torch.tensor([ids]), position_ids=torch.arange(offset, offset + len(ids))[None], cache=cache,
            use_cache=True,
        )
    return kv_of_cache(cache, start=len(engine.prefix_ids))


# Beyond a few hundred positions the reference itself drifts: HF computes position·θ in float32 (angle error
# ~1e-4 rad at 1000), while rope_shift uses float64 angles. The shift is checked where the reference is exact.
@pytest.mark.parametrize("delta", [1, 37, 200])
def test_rope_shift_equals_encoding_at_offset(engine, delta):
    block = engine.encode(ITEMS[:1])[0]
    reference = _encode_at(engine, ITEMS[0], delta)
    for spec in engine.loaded.layout.layers:
        shifted = rope_shift(block.kv[spec.index, 0], delta, spec.inv_freq)
        assert (shifted - reference[spec.index, 0]).abs().max() < 1e-4
        assert torch.equal(block.kv[spec.index, 1], block.kv[spec.index, 1])  # values never move
        assert (block.kv[spec.index, 1] - reference[spec.index, 1]).abs().max() < 1e-4


def test_rope_shift_is_not_identity(engine):
    block = engine.encode(ITEMS[:1])[0]
    spec = engine.loaded.layout.layers[0]
    assert (rope_shift(block.kv[0, 0], 5, spec.inv_freq) - block.kv[0, 0]).abs().max() > 1e-3


def test_one_block_at_encoded_positions_equals_text(engine):
    blocks = engine.encode(ITEMS[:1])
    q = engine.question_ids("where did caroline go?")
    text, kv = engine.prefill(q, blocks, "text"), engine.prefill(q, blocks, "kv")
    assert (text.logits - kv.logits).abs().max() < 1e-4
    for _ in range(4):  # and decoding continues identically
        tok = int(text.logits.argmax())
        engine.step(text, tok)
        engine.step(kv, tok)
        assert (text.logits - kv.logits).abs().max() < 1e-4


def test_k_blocks_cache_length_and_windows(engine):
    blocks = engine.encode(ITEMS)
    q = engine.question_ids("what did melanie paint?")
    seq = engine.prefill(q, blocks, "kv")
    expected = len(engine.prefix_ids) + sum(b.num_tokens for b in blocks) + len(q)
    assert seq.length == expected == seq.cache.get_seq_length()
    for spec, layer in zip(engine.loaded.layout.layers, seq.cache.layers):
        held = layer.keys.shape[-2]
        assert held == (expected if spec.sliding_window is None else min(expected, spec.sliding_window - 1))
    tokens = []
    for _ in range(5):
        tok = int(seq.logits.argmax())
        tokens.append(tok)
        engine.step(seq, tok)
    assert seq.length == expected + 5 and len(seq.generated) == 5


def test_multi_block_injection_matches_manual_rotation(engine):
    """k>1: each block's keys equal its encoded keys rotated by (target start - encoded start)."""
    blocks = engine.encode(ITEMS)
    layout = engine.loaded.layout
    cache = injected_cache(engine.prefix_kv, blocks, layout, engine.loaded.model.config, windowed=False)
    kv = kv_of_cache(cache)
    pos = len(engine.prefix_ids)
    for b in blocks:
        for spec in layout.layers:
            want = rope_shift(b.kv[spec.index, 0], pos - b.start_pos, spec.inv_freq)
            assert torch.allclose(kv[spec.index, 0, :, pos : pos + b.num_tokens], want, atol=1e-6)
            assert torch.equal(kv[spec.index, 1, :, pos : pos + b.num_tokens], b.kv[spec.index, 1])
        pos += b.num_tokens


def test_packed_encoding_equals_one_by_one(engine):
    """A block depends only on its item and its context: encoding the list at once, or item by item with the
    earlier items as context only (as the server does for a new memory), gives the same blocks."""
    packed = engine.encode(ITEMS, batch_tokens=4096)
    single = [engine.encode(ITEMS[: i + 1], only={item.id})[0] for i, item in enumerate(ITEMS)]
    for a, b in zip(packed, single):
        assert a.token_ids == b.token_ids and a.start_pos == b.start_pos
        assert a.extra["context"] == b.extra["context"]
        assert (a.kv - b.kv).abs().max() < 1e-4
    assert packed[0].start_pos == len(engine.prefix_ids) and packed[-1].start_pos > len(engine.prefix_ids)
    assert packed[-1].extra["context"] == "m0,m1,m2"


def test_context_is_whole_preceding_items_within_budget(engine):
    lengths = [b.num_tokens for b in engine.encode(ITEMS, context_tokens=0)]
    budget = lengths[1] + lengths[2]  # room for m1 and m2 behind m3, not for m0 too
    blocks = engine.encode(ITEMS, context_tokens=budget)
    assert blocks[3].extra["context"] == "m1,m2"
    assert blocks[3].start_pos == len(engine.prefix_ids) + budget
    assert all(b.extra["context"] == "" for b in engine.encode(ITEMS, context_tokens=0))


def test_blocks_in_encoding_order_with_full_context_equal_text(engine):
    """Each block's KV is what text mode computes for its tokens when the prompt holds exactly its context before
    it, so the list injected in order, with every predecessor in context, is the text prompt itself."""
    blocks = engine.encode(ITEMS, context_tokens=10_000)
    q = engine.question_ids("where did caroline go?")
    text, kv = engine.prefill(q, blocks, "text"), engine.prefill(q, blocks, "kv")
    assert (text.logits - kv.logits).abs().max() < 1e-4
    shuffled = [blocks[2], blocks[0], blocks[3], blocks[1]]  # out of order the context no longer matches
    text, kv = engine.prefill(q, shuffled, "text"), engine.prefill(q, shuffled, "kv")
    if not all(spec.sliding_window for spec in engine.loaded.layout.layers):
        assert (text.logits - kv.logits).abs().max() > 1e-4


def test_modes_differ_where_they_should(engine):
    if all(spec.sliding_window for spec in engine.loaded.layout.layers):
        pytest.skip("every layer slides by 8 tokens: the question cannot see the memories at all")
    blocks = engine.encode(ITEMS)
    q = engine.question_ids("where did caroline go?")
    none = engine.prefill(q, blocks, "none")
    kv = engine.prefill(q, blocks, "kv")
    assert none.memory_tokens == 0 and kv.memory_tokens > 0
    assert (none.logits - kv.logits).abs().max() > 1e-3


def test_only_also_encodes_the_items_behind_a_named_one(engine):
    """Editing m1 changes the KV of the items encoded behind it (m2, m3), not of the one before it."""
    got = engine.encode(ITEMS, only={"m1"})
    assert [b.item_id for b in got] == ["m1", "m2", "m3"]
    assert [b.item_id for b in engine.encode(ITEMS, only={"m1"}, context_tokens=0)] == ["m1"]
    before, engine.context_items = engine.context_items, 1  # m3 sees only m2, so m3 does not depend on m1
    try:
        assert [b.item_id for b in engine.encode(ITEMS, only={"m1"})] == ["m1", "m2"]
        assert engine.encode(ITEMS)[3].extra["context"] == "m2"
    finally:
        engine.context_items = before


@pytest.mark.parametrize("family", tm.FAMILIES)
def test_one_pass_injection_fills_the_slot_as_the_torch_path_does(family):
    """bf16 blocks on CPU go into the slot through rotate_place: every slot tensor equals what injected_groups and
    write_groups put there, sliding layers trimmed to their window (8, far shorter than the blocks)."""
    if rotate_place.load() is None:
        pytest.skip("rotate_place.cpp not built here: injection stays on torch")
    eng = tm.engine(family, sliding_window=8, dtype=torch.bfloat16)
    blocks = eng.encode(ITEMS)
    layout = eng.loaded.layout
    fused, torch_path = (SlotCache(layout, torch.bfloat16, torch.device("cpu"), slots=3, capacity=16) for _ in "ab")
    n = inject_into_slot(fused, 1, eng.prefix_kv, blocks, layout)
    assert n == torch_path.write_groups(1, injected_groups(eng.prefix_kv, blocks, layout))
    assert n == len(eng.prefix_ids) + sum(b.num_tokens for b in blocks)
    for a, b in zip(fused.keys + fused.values, torch_path.keys + torch_path.values):
        assert a.shape == b.shape and torch.equal(a, b)
