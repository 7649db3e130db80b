"""Issue 22's decode path: the lean Gemma-3 layers (``inferscale/models/leanlayers.py``) change how many operations
a token costs, never a number: the whole model's logits and cached K/V with them are bit for bit the Hugging Face
layers', for prompts and decode steps, one sequence and a batch; other families and a mismatch keep HF's layers."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from inferscale.engine import Engine, Sampling
from inferscale.engine.loop import GenRequest, TokenEvent
from inferscale.models import leanlayers
from inferscale.models.loader import from_model


def _layers(engine: Engine):
    return list(engine.loaded.model.model.layers)


def _set_lean(engine: Engine, lean: bool) -> None:
    for layer in _layers(engine):
        layer.__class__ = leanlayers.LEAN_CLASSES[layer.inferscale_hf_class] if lean else layer.inferscale_hf_class


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
