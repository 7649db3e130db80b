"""`bench ttft --random-weights`: a random-weight model of a named shape, built on the target device."""

import pytest

from inferscale.bench.random_model import SHAPES, random_engine
from inferscale.engine import MemoryItem
from inferscale.errors import ConfigError


@pytest.mark.slow  # takes the embedded default model's tokenizer
def test_random_llama_has_the_named_shape_and_runs():
    engine = random_engine("llama-tiny", device="cpu", dtype="float32")
    cfg = engine.loaded.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (128, 2, 2)
    assert cfg.vocab_size == len(engine.tokenizer)
    blocks = engine.encode([MemoryItem("m0", "caroline went to paris in may")])
    seq = engine.prefill(engine.question_ids("where did caroline go?"), blocks, "kv")
    assert seq.logits.shape == (cfg.vocab_size,)


def test_llama3_8b_shape_is_llama3_8b():
    s = SHAPES["llama3-8b"]
    assert (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"], s["num_key_value_heads"]) == (
        4096, 32, 32, 8)


def test_unknown_shape_is_a_config_error():
    with pytest.raises(ConfigError):
        random_engine("gpt-17", device="cpu", dtype=None)
