"""Tiny random-weight models of each supported family, with a real tokenizer, so engine tests run in seconds."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")

_WORDS = (
    "the a an and of to in is was for on with as at by from it he she they we you i my your her his their "
    "likes went visited bought painted plays lives works moved loves reads wrote sister brother dog cat car "
    "paris london may june 2023 2022 when where what who did does question answer short facts about user "
    "remembered past conversations conversation assistant caroline melanie support group camping beach"
).split()


@functools.lru_cache(maxsize=1)
def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with byte-ish fallback pieces; small vocab so tiny models stay tiny."""
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(specials + ["▁" + w for w in _WORDS] + chars)}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>", continuing_subword_prefix="", max_input_chars_per_word=100))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never"),
                                                 pre_tokenizers.Split(pattern="\n", behavior="isolated")])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>")
    return fast


def config(family: str, *, sliding_window: int | None = 16):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    vocab = len(tokenizer())
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    if family == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "mistral":
        return MistralConfig(**common, sliding_window=sliding_window, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "gemma3":
        return Gemma3TextConfig(**common, head_dim=16, sliding_window=sliding_window or 512,
                                layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    raise ValueError(family)


def model(family: str, *, seed: int = 0, sliding_window: int | None = 16, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = config(family, sliding_window=sliding_window)
    cfg._attn_implementation = "sdpa"
    m = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # Random init leaves attention nearly uniform; larger weights make positional errors visible in tests.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return m.eval()


def engine(family: str, **kw):
    from inferscale.engine import Engine
    from inferscale.models.loader import from_model

    return Engine(from_model(model(family, **kw), tokenizer(), name=f"tiny-{family}"))


@contextlib.contextmanager
def logit_hook(engine, hook: Callable) -> Iterator[None]:
    """Run ``hook(module, args, kwargs, output)`` after every forward pass of the engine's model while inside (the
    lean pass, which does not call the model's ``forward``, is set aside meanwhile)."""
    handle = engine.loaded.model.register_forward_hook(hook, with_kwargs=True)
    lean, engine.loaded.lean = engine.loaded.lean, None
    try:
        yield
    finally:
        handle.remove()
        engine.loaded.lean = lean


@contextlib.contextmanager
def forced_output(engine, text: str, then_newlines: bool = False) -> Iterator[None]:
    """Make the tiny model say ``text`` token by token (each forward pass strongly prefers the next token), then
    line breaks when ``then_newlines``, else the text again: a known output to cut with stop sequences. Requests
    must run one at a time (a prompt pass restarts the text)."""
    ids = engine.tokenizer(text, add_special_tokens=False).input_ids
    newline = engine.tokenizer.convert_tokens_to_ids("\n")
    passes = [0]

    def hook(_module, _args, kwargs, output):
        if kwargs["input_ids"].shape[1] > 1:  # a prompt pass: a new request starts the text again
            passes[0] = 0
        n = passes[0]
        passes[0] += 1
        token = newline if then_newlines and n >= len(ids) else ids[n % len(ids)]
        output.logits[..., token] += 1e4
        return output

    with logit_hook(engine, hook):
        yield
