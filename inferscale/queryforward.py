"""A query's pass through all-MiniLM-L6-v2 as one short function over weights packed once (issue 22).

Every request embeds its question before anything else happens, so this pass is fixed cost in every mode's first
token. Through sentence-transformers it walks ~90 modules a query (BertModel's mask building, per-layer attention
dispatch, three projection modules where one product will do, the pooler's unused dense layer) and took 9-10 ms for
a 15-token question on the 2-core Zen 4 machine, ~4 ms of it Python; this pass does the same arithmetic in the same
order: the query, key and value projections as one ``f32_linear`` product over their concatenated weights (each
output column is summed alone, so the three are the bits of three products), aten's layer norm, GELU and
``scaled_dot_product_attention``, then the Pooling module's masked mean and the two normalizations ``encode`` applies
(the model's Normalize module, then ``normalize_embeddings``). So every row is ``encode``'s, bit for bit
(tests/store/test_query_batching.py), alone or padded in a batch.

Used only where ``f32_linear`` loaded (its packed weights are the point) and the model is the BERT it was written
for; else the embedder keeps the sentence-transformers forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferscale.kernels import f32_linear


@dataclass(frozen=True)
class _Product:
    """One linear: the kernel's packed weight, its bias and its output width."""

    packed: torch.Tensor
    bias: torch.Tensor
    out: int


@dataclass(frozen=True)
class _Layer:
    qkv: _Product
    attn_out: _Product
    attn_norm: tuple[torch.Tensor, torch.Tensor]
    up: _Product
    down: _Product
    out_norm: tuple[torch.Tensor, torch.Tensor]


class QueryForward:
    """``__call__(features)``: the L2-normalised sentence embeddings [b, dim] of tokenized ``features``
    (``SentenceTransformer.preprocess``'s input_ids and attention_mask)."""

    def __init__(self, bert: torch.nn.Module, pack, product) -> None:
        cfg = bert.config
        self.heads, self.dim, self.eps = cfg.num_attention_heads, cfg.hidden_size, cfg.layer_norm_eps
        self.head_dim = self.dim // self.heads
        self._product = product
        emb = bert.embeddings
        self.word, self.position = emb.word_embeddings.weight.detach(), emb.position_embeddings.weight.detach()
        self.token_type = emb.token_type_embeddings.weight.detach()[:1]
        self.embed_norm = _norm(emb.LayerNorm)

        def product_of(*linears: torch.nn.Module) -> _Product:
            weight = torch.cat([lin.weight.detach() for lin in linears])
            return _Product(pack(weight), torch.cat([lin.bias.detach() for lin in linears]), weight.shape[0])

        self.layers = [_Layer(qkv=product_of(a.self.query, a.self.key, a.self.value),
                              attn_out=product_of(a.output.dense), attn_norm=_norm(a.output.LayerNorm),
                              up=product_of(layer.intermediate.dense), down=product_of(layer.output.dense),
                              out_norm=_norm(layer.output.LayerNorm))
                       for layer in bert.encoder.layer for a in [layer.attention]]

    def __call__(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, mask = features["input_ids"], features["attention_mask"]
        b, n = ids.shape
        # BertEmbeddings' order of sums: words + token type 0, then + positions
        x = (self.word[ids] + self.token_type[0]) + self.position[:n]
        x = self._layer_norm(x, self.embed_norm).reshape(b * n, self.dim)
        keep = None if bool(mask.all()) else mask.bool()[:, None, None, :]  # padded keys masked out
        for layer in self.layers:
            q, k, v = self._linear(x, layer.qkv).view(b, n, 3, self.heads, self.head_dim).unbind(2)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=keep, scale=self.head_dim ** -0.5)
            att = att.transpose(1, 2).reshape(b * n, self.dim)
            x = self._layer_norm(self._linear(att, layer.attn_out) + x, layer.attn_norm)
            x = self._layer_norm(self._linear(F.gelu(self._linear(x, layer.up)), layer.down) + x, layer.out_norm)
        weights = mask.unsqueeze(-1).to(x.dtype)
        pooled = (x.view(b, n, self.dim) * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return F.normalize(F.normalize(pooled, p=2, dim=1), p=2, dim=1)  # the Normalize module, then encode's

    def _linear(self, x: torch.Tensor, p: _Product) -> torch.Tensor:
        return self._product(p.packed, x, p.bias, p.out)

    def _layer_norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), norm[0], norm[1], self.eps)


def _norm(layer_norm: torch.nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    return layer_norm.weight.detach(), layer_norm.bias.detach()


def for_model(model: torch.nn.Module) -> QueryForward | None:
    """The lean pass for a sentence-transformers MiniLM (Transformer, mean Pooling, Normalize) where f32_linear
    loaded here; None otherwise (the caller keeps the model's own forward)."""
    ops = f32_linear.load()
    names = [type(m).__name__ for m in model]
    if ops is None or names != ["Transformer", "Pooling", "Normalize"]:
        return None
    bert, pooling = model[0].auto_model, model[1]
    if (type(bert).__name__ != "BertModel" or getattr(pooling, "pooling_mode", "mean") != "mean"
            or bert.config.hidden_act != "gelu"
            or getattr(bert.config, "position_embedding_type", "absolute") != "absolute"):
        return None
    return QueryForward(bert, *ops)
