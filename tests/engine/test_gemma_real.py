"""The same guarantees once on the real default model (Gemma-3-270M: sliding θ=10k window 512, full θ=1M)."""

import pytest
import torch

from inferscale.engine import Engine, MemoryItem
from inferscale.engine.cache import kv_of_cache
from inferscale.kernels.rope import rope_shift

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    return Engine.load("gemma-3-270m", dtype="float32")


def test_layout_read_from_config(gemma):
    cfg = gemma.loaded.config
    layout = gemma.loaded.layout
    for spec, ltype in zip(layout.layers, cfg.layer_types):
        theta = cfg.rope_parameters[ltype]["rope_theta"]
        d = layout.head_dim
        want = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        assert torch.allclose(spec.inv_freq, want)
        assert spec.sliding_window == (cfg.sliding_window if ltype == "sliding_attention" else None)
    assert {s.layer_type for s in layout.layers} == {"sliding_attention", "full_attention"}


def _encode_at(gemma, ids, offset):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        gemma.loaded.model.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(offset, offset + len(ids))[None],
                                 cache=cache, use_cache=True)
    return kv_of_cache(cache, start=len(gemma.prefix_ids))


# Gemma's keys reach |k| ≈ 80, and HF's reference computes position·θ in float32 before its cos/sin, so the
# reference's own error grows with the absolute position (prefix + item ≈ 60 tokens already gives ≈1e-4 absolute).
# The error is therefore measured relative to max |k|: 1e-4 absolute on the tiny models is ≈1e-5 relative there.
@pytest.mark.parametrize("delta,tol", [(1, 5e-6), (10, 5e-6), (1000, 2e-5)])
def test_rotation_equals_encoding_at_offset(gemma, delta, tol):
    item = MemoryItem("m", "Caroline went to an LGBTQ support group on 7 May 2023 and found it inspiring.")
    ids = gemma.prefix_ids + gemma.item_token_ids(item)
    at0, at_delta = _encode_at(gemma, ids, 0), _encode_at(gemma, ids, delta)
    scale = float(at0[:, 0].abs().max())
    for spec in gemma.loaded.layout.layers:
        err = (rope_shift(at0[spec.index, 0], delta, spec.inv_freq) - at_delta[spec.index, 0]).abs().max() / scale
        assert err < tol, (spec.index, spec.layer_type, float(err))
    # and the packed encoder produced the same keys as a plain forward at the encoded positions
    block = gemma.encode([item])[0]
    assert (block.kv - at0).abs().max() < 1e-4


def test_one_block_equals_text_and_k_blocks_run(gemma):
    items = [MemoryItem(f"m{i}", t) for i, t in enumerate([
        "Caroline went to an LGBTQ support group on 7 May 2023.",
        "Melanie painted a lake sunrise last year.",
        "Caroline is planning to study counseling.",
    ])]
    blocks = gemma.encode(items)
    q = gemma.question_ids("When did Caroline go to the support group?")
    text, kv = gemma.prefill(q, blocks[:1], "text"), gemma.prefill(q, blocks[:1], "kv")
    assert (text.logits - kv.logits).abs().max() < 1e-3
    assert int(text.logits.argmax()) == int(kv.logits.argmax())
    seq = gemma.prefill(q, blocks, "kv")
    assert seq.cache.get_seq_length() == len(gemma.prefix_ids) + sum(b.num_tokens for b in blocks) + len(q)
    answer = gemma.ask("When did Caroline go to the support group?", blocks, "kv")
    assert answer.token_ids and answer.ttft_s > 0
