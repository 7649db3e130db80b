"""Issue 22's decode path: the lean Gemma-3 layers (``inferscale/models/leanlayers.py``) and the lean whole-model
pass over them (``leanmodel.py``) change how many operations a token costs, never a number: the whole model's
logits and cached K/V with them are bit for bit the Hugging Face model's, for prompts and decode steps, one
sequence and a batch; other families and a mismatch keep HF's layers and forward."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from inferscale.engine import Engine, Sampling
from inferscale.engine.loop import GenRequest, TokenEvent
from inferscale.models import leanlayers, leanmodel
from inferscale.models.loader import from_model


def _layers(engine: Engine):
    return list(engine.loaded.model.model.layers)


def _set_lean(engine: Engine, lean: bool) -> None:
    """Lean layers and the lean pass over them, or the Hugging Face layers and ``model(...)``."""
    for layer in _layers(engine):
        layer.__class__ = leanlayers.LEAN_CLASSES[layer.inferscale_hf_class] if lean else layer.inferscale_hf_class
    if lean:
        engine.loaded.lean = engine.__dict__.pop("_lean_model", engine.loaded.lean)
    elif engine.loaded.lean is not None:
        engine._lean_model, engine.loaded.lean = engine.loaded.lean, None


@pytest.fixture(params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def engine(request):
    return Engine(from_model(tm.model("gemma3", dtype=request.param, sliding_window=8), tm.tokenizer()))


def _generate(engine: Engine, prompts: list[list[int]], tokens: int = 12) -> list[list[int]]:
    loop = engine.serving_loop()
    outs: list[list[int]] = [[] for _ in prompts]
    for i, ids in enumerate(prompts):
        loop.add(GenRequest(ids=ids, blocks=[], mode="none", sampling=Sampling(max_new_tokens=tokens, ignore_eos=True),
                            emit=lambda e, i=i: outs[i].append(e.token_id) if isinstance(e, TokenEvent) else None))
    loop.run_until_done()
    return outs


def test_gemma3_layers_are_swapped_and_give_the_same_logits(engine):
    assert all(type(layer).__name__ == "LeanGemma3DecoderLayer" for layer in _layers(engine))
    model = engine.loaded.model
    gen = torch.Generator().manual_seed(1)
    for batch, q_len in ((1, 1), (1, 9), (3, 1), (2, 40)):
        ids = torch.randint(0, model.config.vocab_size, (batch, q_len), generator=gen)
        logits = {}
        for lean in (False, True):
            _set_lean(engine, lean)
            with torch.inference_mode():
                logits[lean] = model(input_ids=ids).logits
        assert torch.equal(logits[False], logits[True]), (batch, q_len)
    _set_lean(engine, True)


def test_a_batch_decodes_the_same_tokens_with_lean_and_hf_layers(engine):
    prompts = [engine.question_ids(q) for q in ("Who is Maya?", "Where did we go last summer with the dog?", "Hi")]
    lean = _generate(engine, prompts)
    _set_lean(engine, False)
    hf = _generate(engine, prompts)
    _set_lean(engine, True)
    assert lean == hf and all(len(o) == 12 for o in lean)


def test_other_families_and_a_mismatch_keep_the_hf_layers(monkeypatch):
    llama = tm.model("llama", dtype=torch.bfloat16)
    assert leanlayers.install_lean_layers(llama) == 0
    gemma = tm.model("gemma3", dtype=torch.bfloat16)
    monkeypatch.setattr(leanlayers, "_same_outputs", lambda layer, base, state: False)  # as where the two differ
    assert leanlayers.install_lean_layers(gemma) == 0
    assert all(type(layer).__name__ == "Gemma3DecoderLayer" for layer in gemma.model.layers)


def test_the_lean_pass_is_installed_and_gives_the_models_logits_and_kv(engine):
    assert isinstance(engine.loaded.lean, leanmodel.LeanGemma3Model)
    gen = torch.Generator().manual_seed(2)
    for batch, q_len, past in ((1, 1, 9), (4, 1, 20), (2, 6, 3)):
        outs = _model_and_lean(engine, batch, q_len, past, gen)
        assert all(torch.equal(a, b) for a, b in zip(*outs)), (batch, q_len, past)


def test_sliding_layers_leave_out_key_blocks_no_row_sees_and_the_numbers_stay(engine, monkeypatch):
    """Past the window and a whole key block, a sliding layer's attention reads the keys from the block its rows'
    windows start in, the full layers every key; logits and K/V stay the model's own."""
    lean, config = engine.loaded.lean, engine.loaded.config
    # float32's flash attention gives other bits for some shapes once blocks are left out: it reads every key
    assert lean.key_block == (leanmodel.KEY_BLOCK if engine.loaded.model.dtype == torch.bfloat16 else None)
    read: list[int] = []
    sdpa = leanlayers.sdpa_attention_forward
    monkeypatch.setattr(leanlayers, "sdpa_attention_forward",
                        lambda module, q, k, v, *a, **kw: read.append(k.shape[-2]) or sdpa(module, q, k, v, *a, **kw))
    gen = torch.Generator().manual_seed(3)
    for batch, q_len, past in ((2, 1, 600), (1, 3, 1100)):
        outs = _model_and_lean(engine, batch, q_len, past, gen, before=read.clear)
        assert all(torch.equal(a, b) for a, b in zip(*outs)), (batch, q_len, past)
        kv_len, first = past + q_len, past - config.sliding_window + 1
        if lean.key_block is None:
            assert read == [kv_len] * config.num_hidden_layers
            continue
        expected = [kv_len - (first - first % leanmodel.KEY_BLOCK) if t == "sliding_attention" else kv_len
                    for t in config.layer_types]
        assert read == expected and min(read) < kv_len, (batch, q_len, past)


def _model_and_lean(engine: Engine, batch: int, q_len: int, past: int, gen: torch.Generator, before=lambda: None):
    """Logits and cached K/V of one pass of ``q_len`` random tokens over ``past`` random cached ones, through the
    model's own forward and through the lean pass (``before`` runs before each), with the serving loop's masks."""
    model, config, lean = engine.loaded.model, engine.loaded.config, engine.loaded.lean
    ids = torch.randint(0, config.vocab_size, (batch, q_len), generator=gen)
    pos = torch.arange(past, past + q_len)[None].expand(batch, -1)
    prior = [torch.randn(2, batch, config.num_key_value_heads, past, config.head_dim, generator=gen)
             .to(model.dtype) for _ in range(config.num_hidden_layers)]
    outs = []
    for run in ("model", "lean"):
        cache, masks = leanmodel_cache(prior), _causal_masks(engine, batch, q_len, past)  # as the loop hands them
        before()
        with torch.inference_mode():
            logits = (model(input_ids=ids, position_ids=pos, attention_mask=masks, cache=cache, use_cache=True).logits
                      if run == "model" else lean(ids, pos, masks, cache, 0))
        outs.append([logits] + [t for layer in cache.layers for t in (layer.keys, layer.values)])
    return outs


def test_a_crop_that_changes_the_numbers_is_not_installed(monkeypatch):
    monkeypatch.setattr(leanmodel, "_same_when_cropped", lambda model, lean: False)  # as where the two differ
    lean = from_model(tm.model("gemma3", dtype=torch.bfloat16, sliding_window=8), tm.tokenizer()).lean
    assert lean is not None and lean.key_block is None
    mask = torch.zeros(1, 1, 1, 2000)
    assert leanmodel.first_key(mask, None) == 0


def test_first_key_rounds_down_to_a_block_and_sees_every_row():
    hidden = torch.finfo(torch.float32).min
    mask = torch.full((2, 1, 1, 2000), hidden)
    mask[0, 0, 0, 1500:] = 0  # row 0 sees keys 1500..
    mask[1, 0, 0, 1100:] = 0  # row 1 from 1100: the first block it starts in is 1024..
    assert leanmodel.first_key(mask, 512) == 1024
    assert leanmodel.first_key(mask == 0, 512) == 1024  # a boolean mask (True: seen) alike
    assert leanmodel.first_key(torch.full((1, 1, 1, 2000), hidden), 512) == 0  # nothing seen: nothing left out
    assert leanmodel.first_key(mask[..., :512], 512) == 0  # one block: nothing to leave out


def test_the_loop_runs_the_lean_pass_and_an_eager_pass_runs_the_model(engine, monkeypatch):
    calls = []
    lean = engine.loaded.lean
    monkeypatch.setattr(engine.loaded, "lean", _Counting(lean, calls))
    prompts = [engine.question_ids("Who is Maya?")]
    _generate(engine, prompts, tokens=3)
    assert len(calls) == 3  # the prompt pass and two decode passes
    assert lean.usable
    config = engine.loaded.model.model.config
    monkeypatch.setattr(config, "_attn_implementation", "eager")  # what kv-recompute's scoring pass sets
    assert not lean.usable


def test_other_families_and_a_mismatch_keep_the_models_own_pass(monkeypatch):
    assert from_model(tm.model("llama", dtype=torch.bfloat16), tm.tokenizer()).lean is None
    monkeypatch.setattr(leanmodel, "_same_outputs", lambda model, lean: False)  # as where the two differ
    assert from_model(tm.model("gemma3", dtype=torch.bfloat16), tm.tokenizer()).lean is None


class _Counting:
    """The lean pass, counting the loop's passes through it (``hidden``: every pass stops before the LM head)."""

    def __init__(self, lean, calls: list) -> None:
        self.lean, self.calls, self.usable = lean, calls, True
        self.head_logits = lean.head_logits

    def hidden(self, *args):
        self.calls.append(args[0].shape)
        return self.lean.hidden(*args)


def leanmodel_cache(prior):
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, kv in enumerate(prior):
        cache.update(kv[0].clone(), kv[1].clone(), i)
    return cache


def _causal_masks(engine: Engine, batch: int, q_len: int, past: int) -> dict[str, torch.Tensor]:
    from inferscale.engine.slots import SlotCache

    slots = SlotCache(engine.loaded.layout, engine.loaded.dtype, engine.loaded.device)
    masks = slots.mask([past] * batch, q_len)
    return masks if isinstance(masks, dict) else {t: masks for t in engine.loaded.config.layer_types}
