"""A pass's last layer computes only what is read after it, once every token's K/V are cached. A prompt pass keeps
one token's logits a row (``leanmodel._kept_tokens``): the kept rows' hidden states and every cached K/V are bit for
bit the whole layer's (the real default model: its products on the weight-major kernels, its attention on
``row_attention``, both row-invariant); where a pass would change kernel on fewer rows, the whole layer runs. A 44-token
kv question ~5 % faster. Encoding memories reads no output at all (``LeanGemma3Model.cache_kv``): the blocks are
bit for bit what the model's own forward caches, ~5 % sooner (docs/bench/HISTORY.md, 2026-12-06)."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from inferscale.engine import Engine, MemoryItem
from inferscale.kernels import row_attention
from inferscale.models import leanmodel
from inferscale.models.loader import from_model
from test_leanlayers import _causal_masks, leanmodel_cache


@pytest.fixture(scope="module")
def engine():
    if row_attention.load() is None:
        pytest.skip("row_attention.cpp not built here: every pass runs its whole last layer")
    return Engine.load()


def _pass(engine: Engine, ids, past: int, prior, keep, trimmed: bool, monkeypatch) -> tuple[torch.Tensor, list]:
    """The kept rows' final hidden states and the cache's K/V of one lean pass of ``ids`` over ``past`` tokens."""
    lean, config = engine.loaded.lean, engine.loaded.config
    last = lean.layers[-1]
    seen: list = []
    step = type(last).lean_step

    def spy(self, *args, **kwargs):
        if self is last:
            seen.append(args[5] if len(args) > 5 else kwargs.get("keep"))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(type(last), "lean_step", spy)
    if not trimmed:
        monkeypatch.setattr(leanmodel.LeanGemma3Model, "_kept_tokens", lambda self, ids, keep: None)
    batch, q_len = ids.shape
    cache, masks = leanmodel_cache(prior), _causal_masks(engine, batch, q_len, past)  # as the loop hands them
    pos = torch.arange(past, past + q_len)[None].expand(batch, -1)
    with torch.inference_mode():
        hidden = lean.hidden(ids, pos, masks, cache, keep)
    monkeypatch.undo()
    assert (seen[0] is not None) == trimmed
    return hidden, [t for layer in cache.layers for t in (layer.keys, layer.values)][: 2 * config.num_hidden_layers]


@pytest.mark.slow
@pytest.mark.parametrize("batch,q_len,past,keep", [(1, 44, 600, "last"), (3, 30, 500, "each"), (1, 128, 200, "last"),
                                                   (4, 20, 700, "each")])
def test_the_last_layer_on_the_kept_tokens_gives_the_whole_layers_numbers(engine, monkeypatch, batch, q_len, past,
                                                                           keep):
    config = engine.loaded.config
    gen = torch.Generator().manual_seed(batch * q_len)
    ids = torch.randint(0, 50_000, (batch, q_len), generator=gen)
    prior = [tuple(torch.randn(batch, config.num_key_value_heads, past, config.head_dim, generator=gen)
                   .to(engine.loaded.dtype) for _ in range(2)) for _ in range(config.num_hidden_layers)]
    kept = 1 if keep == "last" else torch.randint(0, q_len, (batch, 1), generator=gen)
    whole, whole_kv = _pass(engine, ids, past, prior, kept, False, monkeypatch)
    trimmed, trimmed_kv = _pass(engine, ids, past, prior, kept, True, monkeypatch)
    assert trimmed.shape == whole.shape == (batch, 1, config.hidden_size)
    assert torch.equal(trimmed, whole)
    assert all(torch.equal(a, b) for a, b in zip(whole_kv, trimmed_kv))


@pytest.mark.slow
def test_passes_that_would_change_kernel_run_the_whole_last_layer(engine):
    last = engine.loaded.lean.layers[-1]
    rows = engine.loaded.pass_rows
    assert last.keeps_rows(44, 44) and last.keeps_rows(rows, rows // 4)
    assert not last.keeps_rows(16, 1)  # a decode step keeps every token anyway
    assert not last.keeps_rows(rows + 4, 44)  # past the kernels' rows F.linear gives a row other numbers
    assert not last.keeps_rows(2 * 160, 160)  # past row_attention's tokens SDPA does


def test_only_one_kept_token_a_row_is_taken_and_the_tiny_model_keeps_its_whole_layer(monkeypatch):
    lean = from_model(tm.model("gemma3", dtype=torch.bfloat16), tm.tokenizer()).lean
    ids = torch.zeros(3, 5, dtype=torch.long)
    assert lean._kept_tokens(ids, 1) is None  # no weight-major kernel or row_attention for its head size here
    monkeypatch.setattr(type(lean.layers[-1]), "keeps_rows", lambda self, rows, q_len: True)
    assert lean._kept_tokens(ids, 1).tolist() == [4, 4, 4]
    assert lean._kept_tokens(ids, torch.tensor([[0], [3], [4]])).tolist() == [0, 3, 4]
    assert lean._kept_tokens(ids, 0) is None  # every position's logits
    assert lean._kept_tokens(ids, 2) is None  # the last two
    assert lean._kept_tokens(ids, torch.ones(3, 1, dtype=torch.bool)) is None  # a mask, not indices
    assert lean._kept_tokens(ids, torch.tensor([[0, 1], [1, 2], [2, 3]])) is None


FACTS = ["Maya adopted a beagle named Biscuit in March.", "Maya works nights as a nurse at St. Mary's.",
         "Maya's sister Ana lives in Lisbon and visits every spring.", "Maya is allergic to peanuts.",
         "Maya ran her first half marathon in October.", "Maya is learning Portuguese for her trip to Porto."]


def _encoded_both_ways(engine: Engine, monkeypatch) -> tuple[list, list, list]:
    """Blocks of FACTS through the lean pass (its last layer as far as the K/V), then through the model's own
    forward (the lean pass set aside), and the layers whose ``cache_kv`` ran."""
    items = [MemoryItem(id=f"m{i}", text=t) for i, t in enumerate(FACTS)]
    lean = engine.loaded.lean
    last = lean.layers[-1]
    stopped: list = []
    cache_kv = type(last).cache_kv
    monkeypatch.setattr(type(last), "cache_kv", lambda self, *a: stopped.append(self) or cache_kv(self, *a))
    short = engine.encode(items, batch_tokens=64)  # several passes
    engine.loaded.lean = None
    try:
        whole = engine.encode(items, batch_tokens=64)
    finally:
        engine.loaded.lean = lean
    return short, whole, stopped


def test_memories_encode_to_the_models_own_kv_with_the_last_layer_stopped_at_it(monkeypatch):
    engine = Engine(from_model(tm.model("gemma3", dtype=torch.bfloat16, sliding_window=8), tm.tokenizer()))
    short, whole, stopped = _encoded_both_ways(engine, monkeypatch)
    assert stopped and set(stopped) == {engine.loaded.lean.layers[-1]}
    assert len(short) == len(whole) == len(FACTS)
    assert all(a.item_id == b.item_id and torch.equal(a.kv, b.kv) for a, b in zip(short, whole))


@pytest.mark.slow
def test_the_real_models_memory_blocks_are_its_own_forwards(engine, monkeypatch):
    short, whole, stopped = _encoded_both_ways(engine, monkeypatch)
    assert stopped
    assert all(torch.equal(a.kv, b.kv) for a, b in zip(short, whole))
