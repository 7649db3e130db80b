"""The AMX decode kernel (``kernels/amx_linear.cpp``, issue 22): F.linear's numbers bit for bit where weightmajor
uses it, a row's result independent of the rows beside it, a clear error on bad input, and the oneDNN path kept
where it cannot run. Skipped (except the fallback) on a CPU without AMX-BF16 or where it cannot be built."""

from __future__ import annotations

import threading

import pytest
import torch

import tiny_models as tm
from inferscale.kernels import amx_linear, decode_linear
from inferscale.models import weightmajor
from inferscale.models.loader import from_model
from inferscale.models.weightmajor import KERNEL, MAX_ROWS, WeightMajorLinear

F = torch.nn.functional
# Gemma-3-270M's products: fused q/k/v, o, fused gate/up, down; and a slice of the LM head's rows
SHAPES = [(1536, 640), (640, 1024), (4096, 640), (640, 2048), (8192 + 7, 640)]


@pytest.fixture(scope="module")
def kernel():
    op = amx_linear.load()
    if op is None:
        pytest.skip("no AMX-BF16 here, or the kernel could not be built: the model keeps oneDNN")
    return op


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_gives_f_linear_numbers_bit_for_bit(kernel, shape):
    gen = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        for rows in (1, 2, 7, 16, 17, MAX_ROWS):
            x = (torch.randn(rows, shape[1], generator=gen) * rows).to(torch.bfloat16)
            out = kernel(weight, x)
            assert out.shape == (rows, shape[0]) and out.is_contiguous()
            assert torch.equal(out, F.linear(x, weight)), (shape, rows)


def test_a_row_gets_the_same_numbers_whatever_rides_along(kernel):
    """Each output is one accumulator over its own row: 1 row alone, or among 2..100 rows, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(1000, 640, generator=gen).to(torch.bfloat16)
    x = torch.randn(100, 640, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([kernel(weight, x[i: i + 1]) for i in range(100)])
        for rows in (2, 16, 33, 100):
            assert torch.equal(kernel(weight, x[:rows]), alone[:rows]), rows


def test_bad_input_is_refused_with_an_error_naming_it(kernel):
    weight = torch.randn(64, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="in-features differ"):
        kernel(weight, torch.randn(1, 32).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16 only"):
        kernel(weight, torch.randn(1, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel(torch.randn(64, 48).to(torch.bfloat16), torch.randn(1, 48).to(torch.bfloat16))
    assert not amx_linear.fits(torch.randn(64, 48).to(torch.bfloat16))  # weightmajor never hands it one


def test_the_kernel_and_onednn_amx_interleave_on_threads(kernel):
    """oneDNN configures the AMX tiles for its own kernels too: both, alternating on two Python threads, keep
    their numbers."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(2048, 640, generator=gen).to(torch.bfloat16)
    xs = [torch.randn(rows, 640, generator=gen).to(torch.bfloat16) for rows in (1, 5, 32, 200)]
    refs = [F.linear(x, weight) for x in xs]
    errors: list[str] = []

    def run(use_kernel: bool) -> None:
        with torch.inference_mode():
            for _ in range(20):
                for x, ref in zip(xs, refs):
                    out = kernel(weight, x) if use_kernel and x.shape[0] <= MAX_ROWS else F.linear(x, weight)
                    if not torch.equal(out, ref):
                        errors.append(f"{'kernel' if use_kernel else 'oneDNN'} rows={x.shape[0]}")

    threads = [threading.Thread(target=run, args=(k,)) for k in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_bf16_model_runs_its_products_on_the_kernel(kernel):
    model = tm.model("gemma3", dtype=torch.bfloat16, sliding_window=8)
    loaded = from_model(model, tm.tokenizer())
    linears = [m for m in loaded.model.modules() if isinstance(m, WeightMajorLinear)]
    assert linears and all(m.blocks == KERNEL for m in linears)
    fused = [layer.inferscale_lean.fused for layer in loaded.model.model.layers]
    assert all(f.qkv_blocks == KERNEL and f.gate_up_blocks == KERNEL for f in fused)


def test_without_the_kernel_the_model_keeps_onednn(monkeypatch):
    monkeypatch.setattr(decode_linear, "load", lambda: None)  # no AMX or AVX512-BF16 here, or the build failed
    loaded = from_model(tm.model("gemma3", dtype=torch.bfloat16, sliding_window=8), tm.tokenizer())
    linears = [m for m in loaded.model.modules() if isinstance(m, WeightMajorLinear)]
    assert all(m.blocks != KERNEL for m in linears)
    weight = torch.randn(64, 64).to(torch.bfloat16)
    assert weightmajor.checked_blocks(weight) in (1, 2)
