"""Random-weight models shaped like real ones, for timing on a GPU with no model hub (``bench ttft
--random-weights llama3-8b``). Timing depends on shapes, not weights: a Llama-3-8B-shaped model prefills and
decodes exactly as long as the real one. The answers are noise, so these are for TTFT only, never for quality.
"""

from __future__ import annotations

import torch

from inferscale.errors import ConfigError

# Llama-3-8B's published shapes (vocab aside: the tokenizer we have decides it, see random_engine).
SHAPES: dict[str, dict] = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
    # The same family at a size a CPU can build in seconds: the CPU check of this code path.
    "llama-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
}


def random_engine(shape: str, *, device: str | None, dtype: str | None, seed: int = 0):
    """An Engine over a random-weight model of ``shape``, built directly on ``device`` (no 16 GB host copy),
    with the embedded default model's tokenizer (vocabulary size taken from it)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from inferscale.engine import Engine
    from inferscale.models.loader import from_model, load_model, torch_dtype_for

    if shape not in SHAPES:
        raise ConfigError(f"--random-weights {shape!r}: expected one of {', '.join(SHAPES)}")
    tokenizer = load_model(None, device="cpu").tokenizer
    torch_dtype = torch_dtype_for(dtype, device)
    cfg = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, **SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    # The digest names the recipe: hashing 16 GB of random weights would cost more than the benchmark.
    return Engine(from_model(model, tokenizer, name=f"random-{shape}", weights_digest=f"random:{shape}:seed{seed}"))
