"""A Gemma-3 forward pass without the Hugging Face model's per-call machinery, bit for bit its logits (issue 22).

``Gemma3ForCausalLM.__call__`` costs a decode step more than its layers: output-capturing and kwarg-default
decorators, a module call per layer, per-layer rotary reshapes and the ``logits_to_keep`` plumbing run in Python
for every token of every sequence. ``LeanGemma3Model`` runs the same operations in the same order, from the
already-lean layers (``leanlayers.LeanGemma3DecoderLayer.lean_step``): the embedding times its scale, each layer
type's rotary tables made once and shaped once for every layer of that type, the layers, the final norm
(``leanlayers.lean_rms``), the kept rows and the LM head (with the final soft-capping where the config has one).

``install_lean_model`` returns one only when every layer is lean and the pass gives the model's own logits and
cached K/V on ``CHECKS``' shapes; anything else (another family, another attention implementation set at run time,
such as kv-recompute's eager scoring pass) goes through ``model(...)``: ``LoadedModel.logits`` picks.
"""

from __future__ import annotations

import logging

import torch
from transformers.modeling_utils import slice_logits_to_keep

from inferscale.models.leanlayers import LeanGemma3DecoderLayer, norm_weight, lean_rms, rotary_tables

log = logging.getLogger(__name__)
CHECKS = ((1, 1, 6), (3, 1, 11), (2, 5, 9))  # (batch, new tokens, cache length) checked equal at load


class LeanGemma3Model:
    """``model(input_ids, position_ids, attention_mask, cache, logits_to_keep).logits`` for a Gemma-3 causal LM
    whose decoder layers are lean; holds references to the model's own weights (no copy)."""

    def __init__(self, model: torch.nn.Module) -> None:
        base, config = model.model, model.config.get_text_config(decoder=True)
        self.config = config
        self.layers: list[LeanGemma3DecoderLayer] = list(base.layers)
        self.layer_types: list[str] = list(config.layer_types)
        self.embed = base.embed_tokens.weight
        self.embed_scale = base.embed_tokens.embed_scale.to(self.embed.dtype)  # what its forward converts per call
        self.rotary = base.rotary_emb
        self.norm, self.eps = norm_weight(base.norm), base.norm.eps
        self.head = model.lm_head
        self.softcap = config.final_logit_softcapping

    @property
    def usable(self) -> bool:
        """False while another attention implementation is set (kv-recompute's eager pass records weights)."""
        return self.config._attn_implementation == "sdpa"

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | dict[str, torch.Tensor], cache,
                 logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """Logits [B, kept, vocab] of rows ``input_ids`` [B, q] at ``position_ids``; ``cache`` takes their K/V."""
        return self.head_logits(self.hidden(input_ids, position_ids, attention_mask, cache, logits_to_keep))

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | dict[str, torch.Tensor], cache,
               logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The kept rows' final hidden states [B, kept, hidden] (after the final norm): what the LM head reads."""
        h = torch.nn.functional.embedding(input_ids, self.embed) * self.embed_scale
        rotary = {t: rotary_tables(*self.rotary(h, position_ids, t)) for t in set(self.layer_types)}
        masks = attention_mask if isinstance(attention_mask, dict) else None
        for layer, layer_type in zip(self.layers, self.layer_types):
            h = layer.lean_step(h, rotary[layer_type], attention_mask if masks is None else masks[layer_type], cache)
        return slice_logits_to_keep(lean_rms(h, self.norm, self.eps), logits_to_keep)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over ``hidden`` [..., hidden], with the final soft-capping where the config has one."""
        logits = self.head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def model_logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | dict[str, torch.Tensor], cache,
                 logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The same logits through the model's own forward: what the lean pass is checked against and stands in for."""
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
                 use_cache=True, logits_to_keep=logits_to_keep).logits


def install_lean_model(model: torch.nn.Module) -> LeanGemma3Model | None:
    """A ``LeanGemma3Model`` for ``model`` once it is checked to give the model's own logits and K/V, else None."""
    layers = list(getattr(getattr(model, "model", None), "layers", []) or [])
    if not layers or not all(isinstance(layer, LeanGemma3DecoderLayer) for layer in layers):
        return None
    lean = LeanGemma3Model(model)
    if not _same_outputs(model, lean):
        log.info("the lean Gemma-3 pass differs from the model's here; keeping model(...)")
        return None
    return lean


def _same_outputs(model: torch.nn.Module, lean: LeanGemma3Model) -> bool:
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    config = lean.config
    with torch.inference_mode():
        for batch, q_len, kv_len in CHECKS:
            ids = torch.randint(0, config.vocab_size, (batch, q_len), generator=gen)
            past = kv_len - q_len
            pos = torch.arange(past, kv_len)[None].expand(batch, -1)
            mask = torch.zeros(batch, 1, q_len, kv_len, dtype=lean.embed.dtype)
            mask.masked_fill_(torch.ones(q_len, kv_len, dtype=torch.bool).triu(past + 1), torch.finfo(mask.dtype).min)
            masks = {layer_type: mask for layer_type in lean.layer_types}  # as SlotCache.mask hands them
            prior = [torch.randn(2, batch, config.num_key_value_heads, past, config.head_dim, generator=gen)
                     .to(lean.embed.dtype) for _ in lean.layers]
            outs = []
            for run in (model, lean):
                cache = DynamicCache()
                for i, kv in enumerate(prior):
                    cache.update(kv[0].clone(), kv[1].clone(), i)
                logits = (model_logits(model, ids, pos, masks, cache, 1) if run is model
                          else lean(ids, pos, masks, cache, 1))
                outs.append([logits] + [t for layer in cache.layers for t in (layer.keys, layer.values)])
            if not all(torch.equal(a, b) for a, b in zip(*outs)):
                return False
    return True
