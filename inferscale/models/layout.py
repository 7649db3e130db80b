"""Per-layer attention layout read from a model's config: RoPE frequencies and sliding window.

Never hard-coded: Gemma3 mixes sliding layers (θ=10k, window 512) with full layers (θ=1M); Mistral may slide
every layer; Llama/Qwen usually slide none. RoPE frequencies come from the model's own rotary module, so
scaled variants (linear, llama3, yarn) are covered as long as they are position-independent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from inferscale.errors import ModelLoadError

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gemma3")
# Rope types whose frequencies depend on the sequence length cannot be shifted by a fixed rotation.
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class LayerSpec:
    index: int
    layer_type: str  # "full_attention" | "sliding_attention"
    sliding_window: int | None  # tokens a query sees, itself included (HF convention); None = unbounded
    inv_freq: torch.Tensor  # [head_dim // 2] float32


@dataclass(frozen=True)
class ModelLayout:
    layers: tuple[LayerSpec, ...]
    num_kv_heads: int
    head_dim: int
    max_positions: int

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(spec.layer_type for spec in self.layers)

    @property
    def mixed(self) -> bool:
        return len(set(self.layer_types)) > 1

    def freq_groups(self) -> dict[str, tuple[list[int], torch.Tensor]]:
        """Layers grouped by layer type (one inv_freq per group): {type: (layer indices, inv_freq)}."""
        groups: dict[str, tuple[list[int], torch.Tensor]] = {}
        for spec in self.layers:
            groups.setdefault(spec.layer_type, ([], spec.inv_freq))[0].append(spec.index)
        return groups


def read_layout(model: torch.nn.Module) -> ModelLayout:
    cfg = model.config.get_text_config(decoder=True)
    family = getattr(cfg, "model_type", "?")
    if family not in SUPPORTED_FAMILIES:
        raise ModelLoadError(f"model family {family!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})")
    layer_types, layer_kwargs = get_layer_types_and_kwargs(cfg)
    rotary = model.model.rotary_emb
    specs = []
    for i, (ltype, kw) in enumerate(zip(layer_types, layer_kwargs)):
        if ltype not in ("full_attention", "sliding_attention"):
            raise ModelLoadError(f"layer {i}: attention type {ltype!r} is not supported")
        rope_type = _rope_type(rotary, ltype)
        if rope_type in _POSITION_DEPENDENT_ROPE:
            raise ModelLoadError(f"layer {i}: rope type {rope_type!r} depends on sequence length; cannot shift blocks")
        inv_freq = getattr(rotary, f"{ltype}_inv_freq", None)
        if inv_freq is None:
            inv_freq = rotary.inv_freq
        specs.append(
            LayerSpec(
                index=i,
                layer_type=ltype,
                sliding_window=kw.get("sliding_window") if ltype == "sliding_attention" else None,
                inv_freq=inv_freq.detach().to(torch.float32).cpu(),
            )
        )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelLayout(
        layers=tuple(specs),
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        max_positions=cfg.max_position_embeddings,
    )


def _rope_type(rotary: torch.nn.Module, layer_type: str) -> str:
    rt = getattr(rotary, "rope_type", "default")
    if isinstance(rt, dict):
        return rt.get(layer_type, "default")
    return rt
