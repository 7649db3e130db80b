"""Gemma-3's RMSNorm as one call (``kernels/rms_norm.cpp``, issue 22): aten's composite numbers bit for bit, a
clear error on rows it cannot take, the composite kept where it is off. Skipped (except the switch) where the
extension cannot be built here."""

from __future__ import annotations

import pytest
import torch

from inferscale.kernels import amx_linear, bf16_linear, gelu_mul, rms_norm
from inferscale.models.leanlayers import lean_rms


@pytest.fixture(scope="module")
def kernel():
    op = rms_norm.load()
    if op is None:
        pytest.skip("rms_norm.cpp not built here, or aten sums in another order: the composite is used")
    return op


@pytest.mark.parametrize("width", [640, 256, 1152, 2048, 4096, 100, 7, 1])
def test_the_kernel_gives_aten_numbers_bit_for_bit(kernel, width):
    gen = torch.Generator().manual_seed(width)
    w = 1.0 + torch.randn(width, generator=gen) * 0.2
    with torch.inference_mode():
        for scale in (1e-4, 1.0, 7.0, 300.0):
            x = (torch.randn(500, width, generator=gen) * scale).to(torch.bfloat16)
            assert torch.equal(kernel(x, w, 1e-6), rms_norm.reference(x, w, 1e-6)), (width, scale)
        zeros = torch.zeros(3, width, dtype=torch.bfloat16)
        assert torch.equal(kernel(zeros, w, 1e-6), rms_norm.reference(zeros, w, 1e-6))


def test_a_weight_per_head_on_transposed_heads(kernel):
    """q and k normalized together: [B, H, q, D] as a transposed view of [B, q, H, D], one weight row per head."""
    gen = torch.Generator().manual_seed(1)
    heads = (torch.randn(2, 9, 5, 256, generator=gen) * 4).to(torch.bfloat16).transpose(1, 2)
    weight = 1.0 + torch.randn(5, 1, 256, generator=gen) * 0.1
    with torch.inference_mode():
        assert torch.equal(kernel(heads, weight, 1e-6), rms_norm.reference(heads, weight, 1e-6))


def test_rows_it_cannot_take_are_refused_by_name(kernel):
    w = torch.ones(64)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        kernel(torch.randn(2, 64), w, 1e-6)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        kernel(torch.randn(2, 64).to(torch.bfloat16), w.to(torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="weight has 32 values a row, x 64"):
        kernel(torch.randn(2, 64).to(torch.bfloat16), torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="last dimension must be contiguous"):
        kernel(torch.randn(64, 2).to(torch.bfloat16).t(), w, 1e-6)
    with pytest.raises(RuntimeError, match="does not broadcast"):
        kernel(torch.randn(2, 3, 64).to(torch.bfloat16), torch.ones(4, 1, 64), 1e-6)


def test_the_lean_norm_takes_the_kernel_and_keeps_aten_for_other_rows(kernel):
    gen = torch.Generator().manual_seed(3)
    w = 1.0 + torch.randn(64, generator=gen) * 0.1
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    strided = torch.randn(64, 4, generator=gen).to(torch.bfloat16).t()
    with torch.inference_mode():
        for rows in (x, strided, x.float()):  # the kernel's rows; a strided last dimension and float32: aten's
            assert torch.equal(lean_rms(rows, w, 1e-6), rms_norm.reference(rows, w, 1e-6))


def test_q_and_k_in_one_call_give_the_lean_layers_numbers(kernel):
    """Normalized per head, rotated and split: qk_reference's query and key bit for bit, from a slice of a wider
    q/k/v product, with tables per sequence or one for all."""
    op = rms_norm.load_qk()
    assert op is not None
    gen = torch.Generator().manual_seed(7)
    for batch, length, tables in ((1, 1, 1), (4, 3, 4), (2, 33, 1)):
        wide = (torch.randn(batch, length, 7 * 256, generator=gen) * 5).to(torch.bfloat16)
        qk = wide[..., : 5 * 256].reshape(batch, length, 5, 256)
        weight = 1.0 + torch.randn(5, 1, 256, generator=gen) * 0.1
        cos, sin = (torch.randn(tables, 1, length, 256, generator=gen).to(torch.bfloat16) for _ in range(2))
        with torch.inference_mode():
            query, key = op(qk, weight, 1e-6, cos, sin, 4)
            want_q, want_k = rms_norm.qk_reference(qk, weight, 1e-6, cos, sin, 4)
        assert query.shape == (batch, 4, length, 256) and key.shape == (batch, 1, length, 256)
        assert query.is_contiguous() and key.is_contiguous()
        assert torch.equal(query, want_q) and torch.equal(key, want_k), (batch, length, tables)
    with pytest.raises(RuntimeError, match="cos and signed_sin must be bf16"):
        op(qk, weight, 1e-6, cos.float(), sin, 4)
    with pytest.raises(RuntimeError, match="9 query heads of 5"):
        op(qk, weight, 1e-6, cos, sin, 9)
    # float32 rows take aten's operations (the lean layer of a float32 model)
    with torch.inference_mode():
        q32, k32 = rms_norm.qk_norm_rope(qk.float(), weight, 1e-6, cos.float(), sin.float(), 4)
    assert q32.dtype == torch.float32 and k32.shape == (2, 1, 33, 256)


@pytest.mark.parametrize("kernel_module, switch", [(rms_norm, "INFERSCALE_RMS_NORM"),
                                                   (amx_linear, "INFERSCALE_AMX_LINEAR"),
                                                   (bf16_linear, "INFERSCALE_BF16_LINEAR"),
                                                   (gelu_mul, "INFERSCALE_GELU_MUL")])
def test_the_switch_turns_a_kernel_off(monkeypatch, kernel_module, switch):
    monkeypatch.setenv(switch, "0")
    kernel_module.load.cache_clear()
    try:
        assert kernel_module.load() is None
    finally:
        monkeypatch.delenv(switch)
        kernel_module.load.cache_clear()


def test_a_kernel_that_disagrees_with_aten_is_not_used():
    """The load-time check: an operator with other numbers (here, aten's norm with another eps) is refused."""
    assert not rms_norm.agrees(lambda x, w, eps: rms_norm.reference(x, w, 1e-2))
    assert rms_norm.agrees(rms_norm.reference)
