"""Attention of a few new tokens per row, each over its own keys (``kernels/row_attention.cpp``, issue 22): no less
accurate than SDPA against float64, the same bits for a row alone and in any batch, clear errors on what it cannot
take, SDPA kept where it is off. Skipped (except the switch) where the extension cannot be built here."""

from __future__ import annotations

import pytest
import torch

from inferscale.kernels import row_attention
from inferscale.kernels.row_attention import errors, padded_mask

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def kernel():
    op = row_attention.load()
    if op is None:
        pytest.skip("row_attention.cpp not built here (no AVX512-BF16 or no compiler): attention stays SDPA")
    return op


def _inputs(gen, batch, heads, kv_heads, tokens, keys, dim, sharpness=1.0):
    q = (torch.randn(batch, heads, tokens, dim, generator=gen) * sharpness).to(BF16)
    k = torch.randn(batch, kv_heads, keys, dim, generator=gen).to(BF16)
    v = torch.randn(batch, kv_heads, keys, dim, generator=gen).to(BF16)
    return q, k, v


@pytest.mark.parametrize("shape", [(16, 4, 1, 1, 630, 256), (2, 4, 1, 43, 630, 256), (3, 8, 2, 5, 200, 64),
                                   (1, 4, 1, 1, 3000, 256), (5, 2, 2, 1, 129, 128), (2, 4, 1, 128, 700, 256),
                                   (1, 8, 1, 64, 300, 128)])
@pytest.mark.parametrize("sharpness", [1.0, 6.0])
def test_error_against_float64_is_no_larger_than_sdpas(kernel, shape, sharpness):
    batch, heads, kv_heads, tokens, keys, dim = shape
    gen = torch.Generator().manual_seed(keys + tokens)
    q, k, v = _inputs(gen, batch, heads, kv_heads, tokens, keys, dim, sharpness)
    lengths = [max(tokens, keys - 53 * b) for b in range(batch)]
    for mask in (None, padded_mask(lengths, tokens, keys, None, BF16), padded_mask(lengths, tokens, keys, 100, BF16)):
        got = kernel(q, k, v, mask, dim ** -0.5)
        assert got.shape == (batch, tokens, heads, dim) and got.dtype == BF16
        err, sdpa_err, _ = errors(got, q, k, v, mask, dim ** -0.5)
        assert err.mean() <= 1.1 * sdpa_err.mean() and err.max() <= 1.25 * sdpa_err.max() + 1e-3, (shape, mask is None)


def test_additive_bool_and_gapped_masks_mean_what_they_mean_to_sdpa(kernel):
    """Values above the dtype's lowest are added to the scores; hidden keys in the middle of a row stay hidden;
    bool masks show where true."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = _inputs(gen, 3, 4, 1, 2, 300, 256)
    bias = (torch.randn(3, 1, 2, 300, generator=gen) * 2).to(BF16)
    bias[:, :, :, 100:180] = torch.finfo(BF16).min  # a gap
    shown = torch.rand(3, 1, 2, 300, generator=gen) > 0.3
    for mask in (bias, shown, bias.float()):
        err, sdpa_err, _ = errors(kernel(q, k, v, mask, 0.0625), q, k, v, mask, 0.0625)
        assert err.max() <= 1.25 * sdpa_err.max() + 1e-3, mask.dtype


def test_a_row_gets_the_same_bits_alone_and_in_any_batch(kernel):
    """A row's output depends on its own query, keys and mask alone: not on how many other rows there are, nor on
    how far the batch's longest row pads it (SDPA's did: its reduction order follows the padded length)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = _inputs(gen, 6, 4, 1, 1, 1200, 256)
    lengths = [1200, 620, 630, 7, 515, 1024]
    for window in (None, 512):
        mask = padded_mask(lengths, 1, 1200, window, BF16)
        together = kernel(q, k, v, mask, 0.0625)
        for b, n in enumerate(lengths):
            alone = kernel(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], mask[b:b + 1, ..., :n], 0.0625)
            assert torch.equal(alone, together[b:b + 1]), (b, window)
            pair = [b, (b + 1) % len(lengths)]
            assert torch.equal(kernel(q[pair], k[pair], v[pair], mask[pair], 0.0625)[:1], alone)


def test_a_token_gets_the_same_bits_in_whichever_pass_it_comes(kernel):
    """A prompt's new tokens in one pass, split over two (the scheduler's chunks), or one at a time: each token's
    output is the same bits (its keys split at the same absolute indices, whatever the others see)."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = _inputs(gen, 1, 4, 1, 20, 700, 256)
    for window in (None, 300):
        mask = padded_mask([700], 20, 700, window, BF16)
        whole = kernel(q, k, v, mask, 0.0625)
        cut = 700 - 13  # the first pass has the first 7 new tokens, and their keys only
        first = kernel(q[:, :, :7], k[:, :, :cut], v[:, :, :cut], mask[:, :, :7, :cut], 0.0625)
        assert torch.equal(torch.cat([first, kernel(q[:, :, 7:], k, v, mask[:, :, 7:], 0.0625)], dim=1), whole)
        singles = [kernel(q[:, :, t:t + 1], k, v, mask[:, :, t:t + 1], 0.0625) for t in range(20)]
        assert torch.equal(torch.cat(singles, dim=1), whole), window


def test_keys_read_in_place_from_a_strided_slot_view(kernel):
    """The slot cache hands [rows, H_kv, :length] views of a larger tensor: no copy needed, same numbers."""
    gen = torch.Generator().manual_seed(5)
    slots = torch.randn(8, 1, 1024, 256, generator=gen).to(BF16)
    values = torch.randn(8, 1, 1024, 256, generator=gen).to(BF16)
    q = torch.randn(3, 4, 1, 256, generator=gen).to(BF16)
    k, v = slots[2:5, :, :700], values[2:5, :, :700]
    mask = padded_mask([700, 650, 300], 1, 700, None, BF16)
    assert torch.equal(kernel(q, k, v, mask, 0.0625), kernel(q, k.contiguous(), v.contiguous(), mask, 0.0625))


def test_a_query_that_sees_no_key_gets_zeros(kernel):
    q, k, v = _inputs(torch.Generator().manual_seed(6), 2, 4, 1, 1, 40, 256)
    mask = torch.zeros(2, 1, 1, 40, dtype=BF16)
    mask[1] = torch.finfo(BF16).min
    out = kernel(q, k, v, mask, 0.0625)
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[0]) > 0


@pytest.mark.parametrize("bad,message", [
    (lambda q, k, v, m: (q.float(), k, v, m), "bfloat16"),
    (lambda q, k, v, m: (q, k[:, :, :, :128], v, m), "\\[B, H_kv, K, D\\]"),
    (lambda q, k, v, m: (torch.zeros(2, 9, 1, 256, dtype=BF16), k, v, m), "times the key heads"),
    (lambda q, k, v, m: (q[..., :96], k[..., :96], v[..., :96], m), "multiple of 64"),
    (lambda q, k, v, m: (q, k, v, m[..., :10]), "mask must be"),
    (lambda q, k, v, m: (q, k, v, m.to(torch.int32)), "mask must be bfloat16"),
    (lambda q, k, v, m: (q.expand(2, 4, 129, 256), k, v, None), "1..128 new tokens"),
    (lambda q, k, v, m: (torch.zeros(2, 8, 65, 256, dtype=BF16), k, v, None), "at most 512 per key head"),
])
def test_what_it_cannot_take_is_a_clear_error(kernel, bad, message):
    q, k, v = _inputs(torch.Generator().manual_seed(7), 2, 4, 1, 1, 40, 256)
    mask = torch.zeros(2, 1, 1, 40, dtype=BF16)
    with pytest.raises(RuntimeError, match=message):
        kernel(*bad(q, k, v, mask), 0.0625)


def test_the_layers_take_what_the_kernel_takes():
    """``fits`` is the C++'s own rule: a whole prompt chunk of the scheduler's (128 tokens) with Gemma's four query
    heads a key head, half that with eight."""
    from inferscale.engine.scheduler import SchedulerConfig
    assert row_attention.fits(SchedulerConfig().chunk_tokens, 4) and row_attention.fits(1, 8)
    assert not row_attention.fits(129, 1) and not row_attention.fits(65, 8) and row_attention.fits(64, 8)


def test_switched_off_it_is_not_loaded(monkeypatch):
    monkeypatch.setenv("INFERSCALE_ROW_ATTENTION", "0")
    row_attention.load.cache_clear()
    try:
        assert row_attention.load() is None
    finally:
        monkeypatch.delenv("INFERSCALE_ROW_ATTENTION")
        row_attention.load.cache_clear()
