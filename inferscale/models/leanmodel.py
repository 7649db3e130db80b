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

A pass that keeps one position a row (a prompt pass: its last token's logits) runs its last layer on all of them
only as far as their K/V, which later tokens read; that layer's attention and MLP run on the kept positions alone
(``_kept_tokens``), where the layer's kernels give a row the same bits in a smaller call
(``LeanGemma3DecoderLayer.keeps_rows``). A 44-token kv question 46.5 -> 44.3 ms, a 128-token chunk 100 -> 96 ms
(the 2-core Zen 4 machine, 2026-12-06).

A sliding-window layer's attention reads only the keys some row of the pass can see, from the first ``KEY_BLOCK``
boundary before them (``first_key``): torch's CPU flash attention takes the keys in blocks of 512, and in bfloat16
a leading block no row sees adds nothing to any value, so dropping it changes no bit (torch 2.13, measured: 262
random shapes equal, and 116 more whose rows sit 600-3,400 tokens apart; dropping 128 or 256 keys differs, and so
does float32, 17 of 104 shapes: float32 models read every key). Checked on the model at install
(``_same_when_cropped``). The full-attention layers read every key. With Gemma-3-270M's 512-token window a
decode step at 1,500 tokens reads 988 keys on 15 of its 18 layers: one row's attention there 1.86 -> 1.25 ms a
layer, 16 rows' 30 -> 18 ms (SDPA alone, this 2-core machine).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from transformers.modeling_utils import slice_logits_to_keep

from inferscale.models.leanlayers import LeanGemma3DecoderLayer, norm_weight, lean_rms, rotary_tables

log = logging.getLogger(__name__)
CHECKS = ((1, 1, 6), (3, 1, 11), (2, 5, 9))  # (batch, new tokens, cache length) checked equal at load
KEY_BLOCK = 512  # keys per block of torch's CPU flash attention: whole leading blocks no row sees may be left out
CROP_CHECKS = ((2, 1), (1, 4))  # (batch, new tokens) checked equal with leading key blocks left out


def first_key(mask: torch.Tensor | None, block: int | None) -> int:
    """The first index of the keys any row of ``mask`` [B, 1, q, K] sees (additive: ``finfo.min`` where hidden;
    or boolean), rounded down to a multiple of ``block``: the keys before it can be left out. 0 without a block
    or a mask, or where the keys fit in one block."""
    if block is None or mask is None or mask.shape[-1] <= block:
        return 0
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    seen = visible.reshape(-1, visible.shape[-1]).any(0)
    first = int(seen.to(torch.uint8).argmax())  # 0 where no key is seen at all: nothing left out
    return first - first % block


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
        self.key_block: int | None = None  # KEY_BLOCK once install_lean_model checked leaving blocks out
        # called after every layer but the last while set: the serving loop runs another tenant's short prompt pass
        # there (engine/interject.py); it must not touch this pass's rows, which then go on where they were
        self.between_layers: Callable[[], None] | None = None

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
        h, rotary, masks, starts = self._inputs(input_ids, position_ids, attention_mask)
        h = self._all_but_last(h, rotary, masks, starts, cache, self.between_layers)
        keep = self._kept_tokens(input_ids, logits_to_keep)
        t = self.layer_types[-1]
        h = lean_rms(self.layers[-1].lean_step(h, rotary[t], masks[t], cache, starts[t], keep), self.norm, self.eps)
        return h if keep is not None else slice_logits_to_keep(h, logits_to_keep)

    def cache_kv(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | dict[str, torch.Tensor], cache) -> None:
        """Only every layer's K/V of ``input_ids`` into ``cache``, as ``hidden`` writes them: its last layer stops
        there (encoding memories keeps their K/V and reads no output, engine/encoder.py)."""
        h, rotary, masks, starts = self._inputs(input_ids, position_ids, attention_mask)
        h = self._all_but_last(h, rotary, masks, starts, cache, None)
        self.layers[-1].cache_kv(h, rotary[self.layer_types[-1]], cache)

    def _all_but_last(self, h: torch.Tensor, rotary: dict, masks: dict, starts: dict, cache,
                      between: Callable[[], None] | None) -> torch.Tensor:
        """``h`` through every layer but the last, ``between`` run after each (no hook after the last layer)."""
        for layer, t in zip(self.layers[:-1], self.layer_types):
            h = layer.lean_step(h, rotary[t], masks[t], cache, starts[t])
            if between is not None:
                between()
        return h

    def _inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | dict[str, torch.Tensor]):
        """The scaled embeddings, and per layer type the rotary tables, the mask and the first key it shows."""
        h = torch.nn.functional.embedding(input_ids, self.embed) * self.embed_scale
        types = set(self.layer_types)
        rotary = {t: rotary_tables(*self.rotary(h, position_ids, t)) for t in types}
        masks = attention_mask if isinstance(attention_mask, dict) else dict.fromkeys(types, attention_mask)
        starts = {t: first_key(masks[t], self.key_block) for t in types}
        masks = {t: masks[t][..., starts[t]:] if starts[t] else masks[t] for t in types}
        return h, rotary, masks, starts

    def _kept_tokens(self, input_ids: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor | None:
        """[B] the one token of each row whose logits the pass keeps (``logits_to_keep`` 1, the last, or [B, 1]
        indices), where the last layer may compute only those after writing every token's K/V (no other token's
        output is read after it: llama.cpp's ``inp_out_ids`` does the same); None: the whole last layer."""
        batch, q_len = input_ids.shape
        if not self.layers[-1].keeps_rows(batch * q_len, q_len):
            return None
        if isinstance(logits_to_keep, int):
            return torch.full((batch,), q_len - 1, device=input_ids.device) if logits_to_keep == 1 else None
        one_each = logits_to_keep.shape == (batch, 1) and logits_to_keep.dtype != torch.bool  # bool: a mask
        return logits_to_keep.reshape(batch) if one_each else None

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
    measured = lean.embed.dtype == torch.bfloat16 and lean.embed.device.type == "cpu"  # torch's CPU flash kernel
    if getattr(lean.config, "sliding_window", None) and measured:
        lean.key_block = KEY_BLOCK
        if not _same_when_cropped(model, lean):
            log.info("leaving key blocks out changes the attention here; every layer reads every key")
            lean.key_block = None
    return lean


def _same_outputs(model: torch.nn.Module, lean: LeanGemma3Model) -> bool:
    """The lean pass against the model's own on CHECKS' shapes (a causal mask on every layer type)."""
    gen = torch.Generator().manual_seed(0)
    return all(_same_pass(model, lean, batch, q_len, kv_len, None, gen) for batch, q_len, kv_len in CHECKS)


def _same_when_cropped(model: torch.nn.Module, lean: LeanGemma3Model) -> bool:
    """The same with each sliding layer's window in its mask and a cache long enough that the lean pass leaves
    leading key blocks out on them (``first_key``)."""
    gen = torch.Generator().manual_seed(1)
    kv_len = lean.config.sliding_window + KEY_BLOCK + 64
    return all(_same_pass(model, lean, batch, q_len, kv_len, lean.config.sliding_window, gen)
               for batch, q_len in CROP_CHECKS)


def _same_pass(model: torch.nn.Module, lean: LeanGemma3Model, batch: int, q_len: int, kv_len: int,
               window: int | None, gen: torch.Generator) -> bool:
    """One pass of ``q_len`` tokens over ``kv_len - q_len`` random cached ones, through both: the same logits and
    K/V? Sliding layers see ``window`` keys back where it is given (as SlotCache.mask hands them)."""
    from transformers import DynamicCache

    config = lean.config
    with torch.inference_mode():
        ids = torch.randint(0, config.vocab_size, (batch, q_len), generator=gen)
        past = kv_len - q_len
        pos = torch.arange(past, kv_len)[None].expand(batch, -1)
        masks = {t: _mask(batch, q_len, kv_len, window if t == "sliding_attention" else None, lean.embed.dtype)
                 for t in set(lean.layer_types)}
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
    return all(torch.equal(a, b) for a, b in zip(*outs))


def _mask(batch: int, q_len: int, kv_len: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Causal [batch, 1, q_len, kv_len] over a cache of kv_len - q_len tokens, limited to ``window`` keys back."""
    diff = torch.arange(kv_len - q_len, kv_len)[:, None] - torch.arange(kv_len)[None, :]
    hidden = (diff < 0) | (diff >= window if window is not None else False)
    mask = torch.zeros(q_len, kv_len, dtype=dtype).masked_fill_(hidden, torch.finfo(dtype).min)
    return mask[None, None].repeat(batch, 1, 1, 1)
