"""Gemma-3's MLP activation as one call (``kernels/gelu_mul.cpp``, issue 22): aten's gelu(gate) * up bit for bit, a
clear error on rows it cannot take, aten's calls kept where it disagrees (its switch: test_rms_norm's, with the other
kernels'). Skipped (except the check) where the extension cannot be built here."""

from __future__ import annotations

import functools

import pytest
import torch

import tiny_models as tm
from inferscale.engine import Engine
from inferscale.kernels import gelu_mul
from inferscale.models import leanlayers
from inferscale.models.loader import from_model


@pytest.fixture(scope="module")
def kernel():
    op = gelu_mul.load()
    if op is None:
        pytest.skip("gelu_mul.cpp not built here, or torch runs another CPU capability: aten's calls are used")
    return op


@pytest.mark.parametrize("shape", [(1, 2048), (16, 2048), (2, 3, 64), (500, 128)])
def test_the_kernel_gives_aten_numbers_bit_for_bit(kernel, shape):
    *rows, inter = shape
    gen = torch.Generator().manual_seed(inter)
    with torch.inference_mode():
        for scale in (1e-3, 1.0, 4.0, 60.0):
            gate_up = (torch.randn(*rows, 2 * inter, generator=gen) * scale).to(torch.bfloat16)
            got = kernel(gate_up, inter)
            assert got.shape == (*rows, inter)
            assert torch.equal(got, gelu_mul.reference(gate_up, inter)), (shape, scale)
        zeros = torch.zeros(*rows, 2 * inter, dtype=torch.bfloat16)
        assert torch.equal(kernel(zeros, inter), gelu_mul.reference(zeros, inter))


def test_every_gate_value_gives_atens_bits(kernel):
    """The kernel looks aten's gelu up by the gate's 16 bits: every one of the 65,536 patterns (infinities, NaNs,
    subnormals included), each against several up values, equals aten's gelu(gate) * up bit for bit."""
    gate = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 2048)
    gen = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for up in (torch.ones_like(gate), (torch.randn(gate.shape, generator=gen) * 3).to(torch.bfloat16)):
            gate_up = torch.cat([gate, up], dim=-1)
            got, want = kernel(gate_up, 2048), gelu_mul.reference(gate_up, 2048)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_rows_it_cannot_take_are_refused_by_name(kernel):
    with pytest.raises(RuntimeError, match="gelu_tanh_mul: gate_up must be bfloat16"):
        kernel(torch.randn(2, 128), 64)
    with pytest.raises(RuntimeError, match="gelu_tanh_mul: gate_up's last dimension must be 2 \\* inter"):
        kernel(torch.randn(2, 130).to(torch.bfloat16), 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel(torch.randn(2, 40).to(torch.bfloat16), 20)
    with pytest.raises(RuntimeError, match="rows must be contiguous"):
        kernel(torch.randn(128, 2).to(torch.bfloat16).t(), 64)


def test_the_lean_layers_take_it_for_the_tanh_gelu_only(kernel):
    """A bf16 Gemma-3's lean layers hold the operator (test_leanlayers checks their logits equal the Hugging Face
    layers' bit for bit); an activation other than aten's tanh gelu is not taken for one."""
    engine = Engine(from_model(tm.model("gemma3", dtype=torch.bfloat16), tm.tokenizer()))
    states = [layer.inferscale_lean for layer in engine.loaded.model.model.layers]
    assert states and all(state.gelu_mul is kernel for state in states)
    assert leanlayers._gelu_tanh(functools.partial(torch.nn.functional.gelu, approximate="tanh"))
    assert not leanlayers._gelu_tanh(torch.nn.functional.gelu)
    assert not leanlayers._gelu_tanh(functools.partial(torch.nn.functional.gelu, approximate="none"))


def test_an_operator_that_disagrees_with_aten_is_not_used():
    """The load-time check: an operator with other numbers (here, gelu without the tanh approximation) is refused."""
    def exact_gelu(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        return torch.nn.functional.gelu(gate_up[..., :inter]) * gate_up[..., inter:]

    assert not gelu_mul.agrees(exact_gelu)
    assert gelu_mul.agrees(gelu_mul.reference)
