"""The AVX2 product kernel (``kernels/avx2_linear.cpp``: bf16 models on CPUs without AVX512-BF16, such as AMD Zen 3):
aten's summation order shown by cancelling weights, NaN and infinities as aten gives them, a clear error on bad
input, and a bf16 model's products on it at every row count (F.linear's bits at the model's shapes and row counts,
rows independent of each other: ``test_packed_products.py``). Skipped on a CPU without AVX2 and FMA or where it
cannot be built. The kernel copies the arithmetic of aten's AVX2 build: on a CPU where aten dispatches to its AVX512
build (and oneDNN takes bf16 products) F.linear's bits are other ones, so the comparisons with F.linear are skipped
there (``decode_linear`` picks an AVX512 kernel on such CPUs) and these tests run only the kernel itself."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
from inferscale.kernels import avx2_linear, decode_linear
from inferscale.models.loader import from_model
from inferscale.models.weightmajor import KERNEL, WeightMajorLinear

F = torch.nn.functional


@pytest.fixture(scope="module")
def product():
    op = avx2_linear.load()
    if op is None:
        pytest.skip("no AVX2 and FMA here, or the kernel could not be built")
    return op


def atens_avx2_build() -> None:
    """Skip unless aten runs its AVX2 build here: the arithmetic the kernel reproduces (on AVX512 its own)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        pytest.skip(f"aten runs its {capability} build here, not the AVX2 one whose bits the kernel reproduces")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # NaN compares equal to itself here


def test_cancelling_weights_show_the_chains_and_tree_are_atens():
    """+2^24 at in-feature 0, -2^24 at the last, 1 at c: whether c's 1 survives depends on which of the 64 chains
    it sits in and where the reduction tree meets the +2^24 (a 1 added to 2^24 in fp32 is lost). Random rows rarely
    tell summation orders apart; these do, per c."""
    if avx2_linear.load() is None:
        pytest.skip("no AVX2 and FMA here")
    atens_avx2_build()
    for in_features in (640, 2048):
        weight = torch.zeros(in_features - 2, in_features)
        weight[:, 0], weight[:, -1] = 2.0 ** 24, -(2.0 ** 24)
        weight[torch.arange(in_features - 2), torch.arange(1, in_features - 1)] = 1.0
        weight = weight[: (in_features - 2) // 16 * 16].to(torch.bfloat16)
        with torch.inference_mode():
            for rows in (1, 7):
                x = torch.ones(rows, in_features).to(torch.bfloat16)
                out, ref = avx2_linear.product(weight, x), F.linear(x, weight)
                assert torch.equal(out, ref), (in_features, rows)
                assert 0 < int((out[0] == 0).sum()) < len(weight)  # both kinds of c occur


def test_nan_and_infinities_come_out_as_atens(product):
    atens_avx2_build()
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 128, generator=gen)
    weight[0, 5], weight[1, 7], weight[2, :] = float("inf"), float("nan"), 3e38  # inf, NaN, overflow to inf
    weight[3, 0], weight[3, 64] = float("inf"), float("-inf")  # inf - inf: NaN
    weight = weight.to(torch.bfloat16)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    x[4] = 0.0  # 0 * inf: NaN
    with torch.inference_mode():
        out, ref = product(weight, x), F.linear(x, weight)
    assert torch.equal(bits(out), bits(ref))
    assert out[:, :4].isnan().any() and out[:, :4].isinf().any()


def test_bad_input_is_refused_with_an_error_naming_it(product):
    pack, op = torch.ops.inferscale_avx2.avx2_pack, torch.ops.inferscale_avx2.avx2_linear
    weight = torch.randn(64, 128).to(torch.bfloat16)
    packed = pack(weight)
    with pytest.raises(RuntimeError, match="x must be bf16 \\[rows, 128\\]"):
        op(packed, torch.randn(1, 64).to(torch.bfloat16), 64)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        op(packed, torch.randn(1, 128), 64)
    with pytest.raises(RuntimeError, match="packed by avx2_pack"):
        op(weight, torch.randn(1, 128).to(torch.bfloat16), 64)
    with pytest.raises(RuntimeError, match="out_features 65 does not match the packed weight's 4 groups of 16"):
        op(packed, torch.randn(1, 128).to(torch.bfloat16), 65)
    with pytest.raises(RuntimeError, match="out_features 48 does not match"):
        op(packed, torch.randn(1, 128).to(torch.bfloat16), 48)
    with pytest.raises(RuntimeError, match="in-features a multiple of 64"):
        pack(torch.randn(64, 48).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        pack(torch.randn(64, 64))
    assert not avx2_linear.fits(torch.randn(48, 40).to(torch.bfloat16))
    assert avx2_linear.fits(torch.randn(48, 64).to(torch.bfloat16))


@pytest.mark.parametrize("out", [1, 15, 17, 174, 4099])
def test_out_features_that_end_mid_group_are_f_linears(product, out):
    """A last group of fewer than 16 outputs (a tiny model's 174-token head, a 4,099-row one): packed with zero rows,
    its real outputs F.linear's bits, the padding never returned."""
    atens_avx2_build()
    gen = torch.Generator().manual_seed(out)
    weight = torch.randn(out, 128, generator=gen).to(torch.bfloat16)
    for rows in (1, 7, 33):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        got = product(weight, x)
        assert got.shape == (rows, out) and got.is_contiguous()
        assert torch.equal(bits(got), bits(F.linear(x, weight))), (out, rows)


def test_a_bf16_model_runs_its_products_on_the_kernel_at_every_row_count(product):
    if decode_linear.load() is not product:
        pytest.skip("AVX512 here: decode_linear picks its own kernel")
    loaded = from_model(tm.model("gemma3", dtype=torch.bfloat16, sliding_window=8), tm.tokenizer())
    linears = [m for m in loaded.model.modules() if isinstance(m, WeightMajorLinear)]
    fitting = [m for m in linears if avx2_linear.fits(m.weight)]
    assert fitting and all(m.blocks == KERNEL and m.max_rows > 10 ** 9 for m in fitting)
    x = torch.randn(300, fitting[0].in_features).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(fitting[0](x), F.linear(x, fitting[0].weight))
