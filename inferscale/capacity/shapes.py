"""What a model's KV costs: bytes per token from its shape and the stored layout of each kv dtype."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from inferscale.contract import KV_DTYPES
from inferscale.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model that size its KV and its prefill: layers, KV heads, head dim, parameter count."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: float

    def bytes_per_token(self, kv_dtype: str) -> int:
        """Stored bytes of one token's K/V in ``kv_dtype`` (``kvquant``'s layout: values and scales)."""
        from inferscale.kvquant import stored_bytes_per_token  # torch: only when a plan is computed

        return stored_bytes_per_token(kv_dtype, layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim)

    def all_bytes_per_token(self) -> dict[str, int]:
        return {d: self.bytes_per_token(d) for d in KV_DTYPES}

    def prefill_tokens_per_s(self, flops: float) -> float:
        """Tokens a second a device sustaining ``flops`` prefills: 2 × params FLOPs a token."""
        return flops / (2.0 * self.params)


# Published configs (layers, KV heads, head dim) and parameter counts.
KNOWN: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llama-3-8b", 32, 8, 128, 8.03e9),
    ModelShape("llama-3-70b", 80, 8, 128, 70.6e9),
    ModelShape("gemma-3-270m", 18, 1, 256, 0.268e9),
)}


def _config_params(cfg: dict, layers: int, kv_heads: int, head_dim: int) -> float:
    """Parameter count from an HF config: embeddings, attention and a gated MLP per layer."""
    hidden = cfg["hidden_size"]
    heads = cfg.get("num_attention_heads", kv_heads)
    inter = cfg.get("intermediate_size", 4 * hidden)
    vocab = cfg.get("vocab_size", 0)
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", True) else 2)
    return float(embed + layers * (attn + 3 * hidden * inter))


def from_config(path: Path) -> ModelShape:
    """A model's shape from its HF ``config.json`` (a multimodal one's ``text_config``)."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model config {path}: {e}") from None
    cfg = cfg.get("text_config", cfg)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        params = _config_params(cfg, layers, kv_heads, head_dim)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(f"model config {path}: missing or bad field {e}") from None
    return ModelShape(Path(path).parent.name or "config", layers, kv_heads, head_dim, params)


def model_shape(name_or_path: str) -> ModelShape:
    """A known model name, or a path to an HF ``config.json`` (or its directory)."""
    if name_or_path in KNOWN:
        return KNOWN[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"model {name_or_path!r}: not one of {', '.join(KNOWN)} and no config.json there")
    return from_config(path)
