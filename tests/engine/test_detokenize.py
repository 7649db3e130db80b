"""The answer's text token by token (``engine/detokenize.py``, issue 22): tokenizers' ``DecodeStream`` gives what
``tokenizer.decode`` of the whole output gives, at every token where that is complete, on Gemma's real tokenizer
(byte-fallback pieces, special tokens, multi-byte characters split across tokens) and on the tiny models' one. Byte
pieces that never form a character are replacement characters either way, not always as many."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

import tiny_models as tm
from inferscale.engine.detokenize import AnswerText
from inferscale.models.loader import _default_model_dir


@pytest.fixture(scope="module")
def gemma_tokenizer():
    return AutoTokenizer.from_pretrained(str(_default_model_dir()[0]))


def _check(tokenizer, ids: list[int]) -> int:
    """Token by token, the text is the whole output's decode wherever that holds only whole characters, and a prefix
    of it where it ends in an incomplete one. Returns how many prefixes were compared."""
    answer = AnswerText(tokenizer)
    compared = 0
    for i, token in enumerate(ids, 1):
        answer.add(token)
        whole = tokenizer.decode(ids[:i], skip_special_tokens=True)
        if "\ufffd" in whole[:-1]:  # an invalid byte sequence: its replacement characters may differ (docstring)
            break
        compared += 1
        assert whole.startswith(answer.text), (ids[:i], whole, answer.text)
        if not whole.endswith("\ufffd"):
            assert answer.text == whole, (ids[:i], whole, answer.text)
    return compared


def test_gemma_text_decodes_as_the_whole_output(gemma_tokenizer):
    text = "Maya's café — 3 May 2024: «Biscuit» 🐶 ate 2½ croissants.\n\n  Then: 日本語のテキスト, naïve résumé."
    _check(gemma_tokenizer, gemma_tokenizer(text, add_special_tokens=False).input_ids)


def test_random_gemma_tokens_decode_as_the_whole_output(gemma_tokenizer):
    """Random ids, with byte-fallback pieces (<0x..>, which may never complete a character) and special tokens
    mixed in: what a model may say."""
    rng = random.Random(0)
    vocab = gemma_tokenizer.get_vocab()
    bytes_ = [i for t, i in vocab.items() if t.startswith("<0x")]
    special = list(gemma_tokenizer.all_special_ids)
    compared = 0
    for _ in range(40):
        ids = [rng.choice(bytes_) if rng.random() < 0.1 else rng.choice(special) if rng.random() < 0.05
               else rng.randrange(len(vocab)) for _ in range(60)]
        compared += _check(gemma_tokenizer, ids)
    assert compared > 400


def test_tiny_tokenizer_decodes_as_the_whole_output():
    tok = tm.tokenizer()
    rng = random.Random(1)
    for _ in range(20):
        _check(tok, [rng.randrange(len(tok)) for _ in range(40)])


def test_add_says_whether_the_text_grew(gemma_tokenizer):
    answer = AnswerText(gemma_tokenizer)
    euro = gemma_tokenizer.convert_tokens_to_ids(["<0xE2>", "<0x82>", "<0xAC>"])  # "€" in three byte pieces
    assert [answer.add(t) for t in euro] == [False, False, True] and answer.text == "€"
    assert not answer.add(gemma_tokenizer.eos_token_id) and answer.text == "€"  # skipped: nothing new
