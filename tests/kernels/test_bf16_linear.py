"""The AVX512-BF16 decode kernel (``kernels/bf16_linear.cpp``, issue 22: CPUs without AMX, such as AMD Zen 4):
oneDNN's chains shown by cancelling weights, a clear error on bad input, and the model's products on it (F.linear's
bits at the model's shapes and decode's row counts, rows independent of each other: ``test_packed_products.py``). Skipped on a CPU
without AVX512-BF16 or where it cannot be built; on an AMX CPU ``decode_linear`` picks ``amx_linear`` instead."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from inferscale.engine.scheduler import SchedulerConfig
from inferscale.kernels import amx_linear, bf16_linear, decode_linear
from inferscale.models.loader import from_model
from inferscale.models.weightmajor import KERNEL, WeightMajorLinear, checked_blocks, in_a_batch

F = torch.nn.functional


@pytest.fixture(scope="module")
def product():
    op = bf16_linear.load()
    if op is None:
        pytest.skip("no AVX512-BF16 here, or the kernel could not be built")
    return op


def test_cancelling_weights_show_the_chains_are_onednns(product):
    """+2^24 at in-feature 0, -2^24 at the last, 1 at c: c survives only where it sits in another chain than the
    +2^24 (a 1 added to 2^24 in fp32 is lost). Random rows rarely tell chain lengths apart; these do, per c."""
    for in_features in (640, 2048):
        weight = torch.zeros(in_features - 2, in_features)
        weight[:, 0], weight[:, -1] = 2.0 ** 24, -(2.0 ** 24)
        weight[torch.arange(in_features - 2), torch.arange(1, in_features - 1)] = 1.0
        weight = weight.to(torch.bfloat16)
        with torch.inference_mode():
            for rows in (1, 3):  # a lone row: the chains oneDNN sums a row of a batch in (a lone row of 2048: 512)
                x = torch.ones(rows, in_features).to(torch.bfloat16)
                out, ref = product(weight, x), in_a_batch(x, weight, None)
                assert torch.equal(out, ref), (in_features, rows)
                assert 0 < int((out[0] == 0).sum()) < in_features - 2  # both kinds of c occur


def test_bad_input_is_refused_with_an_error_naming_it(product):
    pack, op = torch.ops.inferscale_bf16.bf16_pack, torch.ops.inferscale_bf16.bf16_linear
    weight = torch.randn(64, 64).to(torch.bfloat16)
    packed = pack(weight)
    with pytest.raises(RuntimeError, match="in-features differ"):
        op(packed, torch.randn(1, 32).to(torch.bfloat16), 512, 64)
    with pytest.raises(RuntimeError, match="bf16 x"):
        op(packed, torch.randn(1, 64), 512, 64)
    with pytest.raises(RuntimeError, match="packed by bf16_pack"):
        op(weight, torch.randn(1, 64).to(torch.bfloat16), 512, 64)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        op(packed, torch.randn(1, 64).to(torch.bfloat16), 512, 65)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        pack(torch.randn(64, 48).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="chain must be"):
        op(packed, torch.randn(1, 64).to(torch.bfloat16), 3, 64)


def test_a_bf16_model_runs_its_products_on_the_decode_kernel(product):
    if amx_linear.load() is not None:
        pytest.skip("AMX here: decode_linear picks amx_linear (tests/engine/test_amx_linear.py)")
    assert decode_linear.load() is product
    loaded = from_model(tm.model("gemma3", dtype=torch.bfloat16, sliding_window=8), tm.tokenizer())
    linears = [m for m in loaded.model.modules() if isinstance(m, WeightMajorLinear)]
    assert linears and all(m.blocks == KERNEL for m in linears)
    assert loaded.pass_rows == bf16_linear.MAX_ROWS == SchedulerConfig().chunk_tokens  # a whole prompt chunk


@pytest.mark.parametrize("kind", ["random", "ties", "all -inf", "nan", "inf and -0"])
def test_rows_argmax_gives_aten_max_indices(product, kind):
    """Each row's first maximum (its first NaN where it has one), as ``max(dim=-1).indices``, at ragged lengths
    (16-lane tails) and the LM head's width."""
    gen = torch.Generator().manual_seed(7)
    argmax = bf16_linear.rows_argmax()
    for rows, n in ((1, 1), (3, 17), (16, 262144), (5, 1000), (2, 33)):
        x = torch.randn(rows, n, generator=gen)
        if kind == "ties":
            x = torch.randint(-2, 2, (rows, n), generator=gen).float()
        elif kind == "all -inf":
            x = torch.full((rows, n), float("-inf"))
        elif kind == "nan":
            x[torch.rand(rows, n, generator=gen) < 0.02] = float("nan")
            x[:, -1] = float("nan")  # every row holds one: the first wins
        elif kind == "inf and -0":
            x[torch.rand(rows, n, generator=gen) < 0.01] = float("inf")
            x[torch.rand(rows, n, generator=gen) < 0.3] = -0.0
        x = x.to(torch.bfloat16)
        assert torch.equal(argmax(x), x.max(dim=-1).indices), (kind, rows, n)


def test_rows_argmax_refuses_what_it_does_not_reduce(product):
    with pytest.raises(RuntimeError, match="contiguous bf16 logits"):
        bf16_linear.rows_argmax()(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="contiguous bf16 logits"):
        bf16_linear.rows_argmax()(torch.randn(8, 2).to(torch.bfloat16).t())


def test_the_heads_argmax_runs_the_kernel_and_gives_aten_indices(product, monkeypatch):
    from inferscale.models import greedyhead

    if amx_linear.load() is not None:
        pytest.skip("AMX here: the products and the argmax stay off bf16_linear")
    assert decode_linear.rows_argmax() is torch.ops.inferscale_bf16.rows_argmax
    calls = []
    real = bf16_linear.rows_argmax()
    monkeypatch.setattr(decode_linear, "rows_argmax", lambda: lambda x: calls.append(x.shape) or real(x))
    logits = torch.randn(16, 5000, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    assert greedyhead.first_max(logits) == logits.max(dim=-1).indices.tolist() and calls == [(16, 5000)]
    assert greedyhead.first_max(logits.float()) == logits.float().max(dim=-1).indices.tolist()  # fp32: aten's
    assert calls == [(16, 5000)]


def test_a_lone_row_of_the_down_projection_gets_what_it_gets_in_a_batch(product):
    """oneDNN sums a lone row of 2048 in-features in chains of 512 and a batch's rows in 1024; the swapped linear
    (on this kernel, checked at install) gives a lone row the batch's numbers, so a request decoded alone and the same
    request decoded beside another get the same tokens (they did not: a load probe, 2026-12-06)."""
    if amx_linear.load() is not None:
        pytest.skip("AMX here: decode_linear picks amx_linear")
    gen = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(2048, 640, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(640, 2048, generator=gen) * 2048 ** -0.5)
    swapped = WeightMajorLinear(linear, KERNEL)
    assert checked_blocks(linear.weight) == KERNEL
    x = torch.randn(5, 2048, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        batch = swapped(x)
        assert all(torch.equal(swapped(x[i:i + 1]), batch[i:i + 1]) for i in range(5))
