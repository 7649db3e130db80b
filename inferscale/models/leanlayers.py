"""Gemma-3 decoder layers with fewer operations per token, bit for bit the Hugging Face layer's outputs (issue 22).

A decode step of Gemma-3-270M runs 18 layers of ~90 small tensor operations each besides its seven weight reads;
on a 2-core CPU those operations cost about as much as reading the layers' weights. ``LeanGemma3DecoderLayer``
computes the same numbers with fewer of them:

- q, k and v come out of ONE weight read (their weights concatenated: ``W_qkv @ x``), gate and up out of another,
  for the few rows of a decode step or a short prompt chunk (``weightmajor.max_rows``); each output row is the same
  dot product accumulated in the same order as the separate projection's, so the values are identical (checked);
- q and k are normalized and rotated together, as one tensor of H + H_kv heads (each head's norm weight broadcast
  over it): every operation there is elementwise or a reduction over one head's own values, so each value is what
  the separate q and k operations give;
- each RMSNorm's ``1 + weight`` in float32 is kept instead of being converted on every call, and the norm is ONE
  call (``kernels/rms_norm.cpp``, else aten's ``rms_norm``: the same float32 operations in the same order); q and
  k are normalized, rotated and split into query and key in one call too (``kernels/rms_norm.qk_norm_rope``);
- ``rotate_half(x) * sin`` is ``roll(x, D/2) * signed_sin`` (``rotary_tables``: sin's first half negated once per
  pass), one operation instead of four; the activation's own function is called, not its module;
- the fused read's rows go through gelu(gate) * up in one call (``kernels/gelu_mul``: aten's own vectorized gelu and
  bf16 product, checked equal to aten's two calls at load) where the activation is the tanh gelu.

The attention of passes of up to ``row_attention.MAX_TOKENS`` new tokens a row (decode steps, kv questions, prompt
chunks) runs ``kernels/row_attention`` once ``install_row_attention`` has put it on the layers (after the check
above, which runs SDPA): each row over its own keys, batch-invariant, 2-3x faster than SDPA, not SDPA's bits (its
error against float64 no larger than SDPA's, checked at load; what it does to answers is measured end to end).
``INFERSCALE_ROW_ATTENTION=0`` keeps SDPA.

Another attention implementation set at run time (kv-recompute's scoring pass sets ``eager`` to record attention
weights) runs transformers' own layer. Prompts of more rows and everything else (attention through transformers'
own ``sdpa_attention_forward``, the residuals) run the same operations as ``Gemma3DecoderLayer``.
``install_lean_layers`` swaps a loaded model's layers only after checking on them that the two give identical
outputs (``CHECKS``: one and several rows, prefill and decode shapes, a mask); any difference, another model family
or another transformers layer class keeps the Hugging Face layers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from inferscale.kernels import decode_linear, gelu_mul, rms_norm, row_attention
from inferscale.models.weightmajor import KERNEL, checked_blocks, max_rows, weight_major_product

log = logging.getLogger(__name__)
CHECKS = ((1, 1, 5), (3, 1, 9), (2, 7, 7), (1, 40, 40))  # (batch, new tokens, cache length) checked equal


class _FusedWeights:
    """A layer's q/k/v weights in one tensor and its gate/up weights in another (decode reads each once). The
    parameters become row slices of them (the same values, contiguous, no second copy in memory): the modules,
    state dict and long prompts use them as before."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _joined([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        self.gate_up = _joined([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.q_rows, self.k_rows = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        self.inter = mlp.gate_proj.weight.shape[0]
        # 0 (no block count gives F.linear's numbers) runs the plain product: the layer's own check decides
        self.qkv_blocks, self.gate_up_blocks = checked_blocks(self.qkv), checked_blocks(self.gate_up)
        self.max_rows = min(max_rows(self.qkv_blocks), max_rows(self.gate_up_blocks))  # rows the fused reads take
        for weight, blocks in ((self.qkv, self.qkv_blocks), (self.gate_up, self.gate_up_blocks)):
            if blocks == KERNEL:
                decode_linear.prepare(weight)


def _joined(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Concatenate ``params`` along their rows and make each a view of its rows of the result."""
    joined = torch.cat([p.detach() for p in params]).contiguous()
    start = 0
    for p in params:
        p.data = joined[start: start + p.shape[0]]
        start += p.shape[0]
    return joined


def norm_weight(norm: torch.nn.Module) -> torch.Tensor:
    return 1.0 + norm.weight.float()


def lean_rms(x: torch.Tensor, weight1: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm's arithmetic with its ``1 + weight`` precomputed, as ONE call (``kernels/rms_norm.norm``: the
    kernel where it takes the rows, else aten's ``rms_norm``, the same float32 operations in the same order, checked
    equal at load with the rest of the layer). A weight of one row per head is applied after the normalization."""
    return rms_norm.norm(x, weight1, eps)


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables [B, q, D] as the lean layers read them: [B, 1, q, D], and ``sin`` with its first half
    negated, so that ``roll(x, D/2) * signed_sin`` is ``rotate_half(x) * sin`` = cat(-x2, x1) * sin in one
    operation fewer and the same bits (IEEE products are symmetric in sign; the negation is exact)."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(1)


class LeanGemma3DecoderLayer(torch.nn.Module):
    """Installed by class swap onto a ``Gemma3DecoderLayer`` (its modules and parameters stay as they are); only
    ``forward`` differs. ``inferscale_lean`` holds the fused weights and the norms' precomputed weights."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, position_ids=None,
                cache=None, **kwargs) -> torch.Tensor:
        if self.self_attn.config._attn_implementation != "sdpa":  # e.g. eager, to record attention weights
            return super(LeanGemma3DecoderLayer, self).forward(  # transformers' own layer (kv-recompute's scores)
                hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                position_ids=position_ids, cache=cache, **kwargs)
        return self.lean_step(hidden_states, rotary_tables(*position_embeddings), attention_mask, cache)

    def lean_step(self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], attention_mask,
                  cache, key_from: int = 0, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` with the rotary tables already made by ``rotary_tables`` (the whole-model pass,
        leanmodel.py, makes them once per layer type, not once per layer). With ``key_from`` the attention reads
        the cached keys from that index on; ``attention_mask`` then covers only those (no row sees the ones
        before: a sliding window's past, ``leanmodel.first_key``). With ``keep`` ([B] token indices, where
        ``keeps_rows`` allows it) every token's K/V still reach ``cache`` but only token keep[b] of row b goes on
        through the attention and the MLP: the output is [B, 1, hidden]."""
        lean: _LeanState = self.inferscale_lean
        residual = hidden_states if keep is None else _kept(hidden_states, keep, 1)
        h = lean_rms(hidden_states, lean.input_norm, lean.eps)
        h = self._attention(h, rotary, attention_mask, cache, key_from, keep)
        h = lean_rms(h, lean.post_attention_norm, lean.eps)
        hidden_states = residual + h
        residual = hidden_states
        h = lean_rms(hidden_states, lean.pre_feedforward_norm, lean.eps)
        h = self._mlp(h)
        h = lean_rms(h, lean.post_feedforward_norm, lean.eps)
        return residual + h

    def keeps_rows(self, rows: int, q_len: int) -> bool:
        """Whether ``lean_step`` may carry one token a row of a pass of ``rows`` tokens (``q_len`` a row) past the
        K/V write with the same bits as the whole pass: where every product of the layer runs on the weight-major
        kernels for ``rows`` (each row then gets the same numbers at any row count, weightmajor.py) and the
        attention on ``row_attention`` (each query over its own keys, batch-invariant). F.linear past its row
        limit and SDPA give a row other numbers in a smaller call."""
        attn, mlp, lean = self.self_attn, self.mlp, self.inferscale_lean
        return (q_len > 1 and lean.weight_major and lean.row_attention is not None
                and row_attention.fits(q_len, lean.group)
                and all(getattr(m, "blocks", None) == KERNEL and rows <= m.max_rows for m in (attn.o_proj,
                                                                                            mlp.down_proj))
                and rows <= lean.fused.max_rows and lean.fused.qkv_blocks == lean.fused.gate_up_blocks == KERNEL)

    def cache_kv(self, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache) -> None:
        """Only the layer's K/V of ``hidden_states`` into ``cache``, the same numbers ``lean_step`` caches: all a
        pass whose output nobody reads needs of its last layer (encoding memories, ``leanmodel.cache_kv``)."""
        lean: _LeanState = self.inferscale_lean
        self._query_key_value(lean_rms(hidden_states, lean.input_norm, lean.eps), rotary, cache)

    def _attention(self, h: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], attention_mask,
                   cache, key_from: int = 0, keep: torch.Tensor | None = None) -> torch.Tensor:
        attn, lean = self.self_attn, self.inferscale_lean
        batch, q_len = h.shape[:2]
        query, key, v = self._query_key_value(h, rotary, cache)
        if key_from:
            key, v = key[:, :, key_from:], v[:, :, key_from:]
        if keep is not None:  # every token's K/V are cached; only the kept tokens' queries go on
            query, q_len = _kept(query, keep, 2), 1
            if attention_mask is not None:
                attention_mask = _kept(attention_mask.expand(batch, -1, -1, -1), keep, 2)
        if lean.row_attention is not None and row_attention.fits(q_len, lean.group):  # [B, q, H, D], row by row
            out = lean.row_attention(query, key, v, attention_mask, attn.scaling)
        else:
            out, _ = sdpa_attention_forward(attn, query, key, v, attention_mask, dropout=0.0, scaling=attn.scaling,
                                            sliding_window=attn.sliding_window)  # what transformers' layer calls
        return attn.o_proj(out.reshape(batch, q_len, -1).contiguous())

    def _query_key_value(self, h: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache):
        """q, k and v of the normed ``h`` [B, heads, q, D]; k and v are what ``cache`` holds after this layer's
        update (the whole past) where there is one."""
        attn, lean = self.self_attn, self.inferscale_lean
        fused = lean.fused
        batch, q_len = h.shape[:2]
        flat = h.reshape(-1, h.shape[-1])
        d = attn.head_dim
        if lean.weight_major and flat.shape[0] <= fused.max_rows:
            qkv = weight_major_product(fused.qkv, flat, fused.qkv_blocks).reshape(batch, q_len, -1)
            qk = qkv[..., : fused.q_rows + fused.k_rows]
            v = qkv[..., fused.q_rows + fused.k_rows:]
        else:
            qk = torch.cat([attn.q_proj(h), attn.k_proj(h)], dim=-1)
            v = attn.v_proj(h)
        v = v.reshape(batch, q_len, -1, d).transpose(1, 2)
        # q and k normalized per head, rotated and split into contiguous [B, heads, q, D] tensors, as the separate
        # q and k are (SDPA takes another kernel path for strided inputs: other bits); one call where it can be
        query, key = rms_norm.qk_norm_rope(qk.reshape(batch, q_len, -1, d), lean.qk_norm, lean.eps, *rotary,
                                           attn.config.num_attention_heads)
        if cache is not None:
            key, v = cache.update(key, v, attn.layer_idx)
        return query, key, v

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        mlp, lean = self.mlp, self.inferscale_lean
        fused = lean.fused
        flat = h.reshape(-1, h.shape[-1])
        if lean.weight_major and flat.shape[0] <= fused.max_rows:
            gate_up = weight_major_product(fused.gate_up, flat, fused.gate_up_blocks).reshape(*h.shape[:-1], -1)
            if lean.gelu_mul is not None and gate_up.stride(-1) == 1:  # aten's gelu and mul in one call, same bits
                return mlp.down_proj(lean.gelu_mul(gate_up, fused.inter))
            gate, up = gate_up[..., : fused.inter], gate_up[..., fused.inter:]
        else:
            gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        return mlp.down_proj(lean.act(gate) * up)


def _kept(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """Index keep[b] of ``x``'s dimension ``dim`` for each b of its first: that dimension becomes 1 (contiguous)."""
    shape = list(x.shape)
    shape[dim] = 1
    index = keep.reshape([-1] + [1] * (x.dim() - 1)).expand(shape)
    return x.gather(dim, index)


class _LeanState:
    def __init__(self, layer: torch.nn.Module) -> None:
        attn = layer.self_attn
        # The fused reads replace weightmajor's per-projection ``W @ x`` (same numbers); where the projections are
        # plain nn.Linear (no weightmajor here), each keeps its own.
        self.weight_major = all(type(m).__name__ == "WeightMajorLinear" for m in (
            attn.q_proj, attn.k_proj, attn.v_proj, layer.mlp.gate_proj, layer.mlp.up_proj))
        self.fused = _FusedWeights(layer) if self.weight_major else None
        self.eps = layer.input_layernorm.eps
        self.row_attention: row_attention.RowAttention | None = None  # install_row_attention sets it
        # the activation's own function (GELUTanh keeps it as ``act``): one module call fewer per layer
        self.act = getattr(layer.mlp.act_fn, "act", layer.mlp.act_fn)
        self.gelu_mul = gelu_mul.load() if self.fused is not None and _gelu_tanh(self.act) and gelu_mul.fits(
            self.fused.inter) else None
        self.input_norm = norm_weight(layer.input_layernorm)
        self.post_attention_norm = norm_weight(layer.post_attention_layernorm)
        self.pre_feedforward_norm = norm_weight(layer.pre_feedforward_layernorm)
        self.post_feedforward_norm = norm_weight(layer.post_feedforward_layernorm)
        d = attn.head_dim
        heads, kv_heads = attn.q_proj.weight.shape[0] // d, attn.k_proj.weight.shape[0] // d
        self.group = heads // kv_heads  # query heads per key head
        # one [1, D] row per head: q's norm weight for the query heads, k's for the key heads
        self.qk_norm = torch.cat([norm_weight(attn.q_norm).expand(heads, 1, d),
                                  norm_weight(attn.k_norm).expand(kv_heads, 1, d)])


def _gelu_tanh(act: Callable) -> bool:
    """Whether the activation is aten's gelu with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return (isinstance(act, functools.partial) and act.func is torch.nn.functional.gelu and not act.args
            and act.keywords == {"approximate": "tanh"})


def _supported(layer: torch.nn.Module) -> bool:
    attn = getattr(layer, "self_attn", None)
    return (type(layer).__name__ == "Gemma3DecoderLayer" and attn is not None
            and getattr(attn, "attn_logit_softcapping", None) is None
            and all(getattr(n, "eps", None) == layer.input_layernorm.eps for n in (
                layer.post_attention_layernorm, layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm,
                attn.q_norm, attn.k_norm))
            and attn.config._attn_implementation == "sdpa" and not attn.training)


def install_lean_layers(model: torch.nn.Module) -> int:
    """Swap every Gemma-3 decoder layer of ``model`` for a ``LeanGemma3DecoderLayer`` once the two are checked to
    give identical outputs on it; returns how many were swapped (0: the model is unchanged)."""
    base = getattr(model, "model", None)
    layers = list(getattr(base, "layers", []) or [])
    if not layers or not all(_supported(layer) for layer in layers):
        return 0
    states = {layer: _LeanState(layer) for layer in layers}
    # one layer of each attention type (sliding and full see other masks and rotary tables)
    checked = {layer.self_attn.layer_type: layer for layer in layers}.values()
    if not all(_same_outputs(layer, base, states[layer]) for layer in checked):
        log.info("lean Gemma-3 layers differ from transformers' here; keeping them")
        return 0
    for layer in layers:
        _make_lean(layer, states[layer])
    return len(layers)


def install_row_attention(model: torch.nn.Module) -> bool:
    """Run short passes' attention on ``kernels/row_attention`` in every lean layer of a bf16 CPU model whose head
    size and query-head group the kernel takes; False (SDPA stays) where it is not built or checked here."""
    layers = list(getattr(getattr(model, "model", None), "layers", []) or [])
    if not layers or not all(isinstance(layer, LeanGemma3DecoderLayer) for layer in layers):
        return False
    attn = layers[0].self_attn
    weight = attn.q_proj.weight
    group = attn.config.num_attention_heads // attn.config.num_key_value_heads
    if not row_attention.takes(weight.dtype, weight.device, attn.head_dim, group):
        return False
    op = row_attention.load()
    if op is None:
        return False
    for layer in layers:
        layer.inferscale_lean.row_attention = op
    return True


LEAN_CLASSES: dict[type, type] = {}


def _make_lean(layer: torch.nn.Module, state: _LeanState) -> None:
    layer.inferscale_lean = state
    layer.inferscale_hf_class = hf = type(layer)
    if hf not in LEAN_CLASSES:  # the Hugging Face class with this forward first in line
        LEAN_CLASSES[hf] = type("LeanGemma3DecoderLayer", (LeanGemma3DecoderLayer, hf), {})
    layer.__class__ = LEAN_CLASSES[hf]


def _same_outputs(layer: torch.nn.Module, base: torch.nn.Module, state: _LeanState) -> bool:
    """The layer's outputs (and the K/V it caches) before and after the swap, on random inputs of CHECKS' shapes."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    weight = layer.input_layernorm.weight
    layer_type = layer.self_attn.layer_type or "full_attention"
    results = []
    for lean in (False, True):
        if lean:
            _make_lean(layer, state)
        outs = []
        gen.manual_seed(0)
        with torch.inference_mode():
            for batch, q_len, kv_len in CHECKS:
                h = torch.randn(batch, q_len, weight.shape[0], generator=gen).to(weight.dtype)
                pos = torch.arange(kv_len - q_len, kv_len)[None].expand(batch, -1)
                cos, sin = base.rotary_emb(h, pos, layer_type)
                past = kv_len - q_len
                cache = DynamicCache()
                if past:
                    shape = (batch, layer.self_attn.config.num_key_value_heads, past, layer.self_attn.head_dim)
                    cache.update(torch.randn(shape, generator=gen).to(weight.dtype),
                                 torch.randn(shape, generator=gen).to(weight.dtype), layer.self_attn.layer_idx)
                mask = torch.zeros(batch, 1, q_len, kv_len, dtype=weight.dtype)
                mask.masked_fill_(torch.ones(q_len, kv_len, dtype=torch.bool).triu(past + 1),
                                  torch.finfo(weight.dtype).min)
                out = layer(h, position_embeddings=(cos, sin), attention_mask=mask, cache=cache)
                k, v = cache.layers[layer.self_attn.layer_idx].keys, cache.layers[layer.self_attn.layer_idx].values
                outs.append((out, k, v))
        results.append(outs)
        if lean:
            layer.__class__ = layer.inferscale_hf_class
            del layer.inferscale_lean, layer.inferscale_hf_class
    return all(torch.equal(a, b) for x, y in zip(*results) for a, b in zip(x, y))
