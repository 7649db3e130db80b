"""What the two kernels that pack a copy of the weight (``kernels/bf16_linear.cpp`` on AVX512-BF16, issue 22;
``kernels/avx2_linear.cpp`` on AVX2) must both give: F.linear's numbers bit for bit at Gemma-3-270M's shapes and at
the row counts each takes (a lone row: F.linear's for it in a batch), a row's result independent of the rows beside
it, and a new packed copy once the weight
is written in place (``cppext.kept_packing``). Each kernel is skipped where it cannot run here."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from inferscale.kernels import avx2_linear, bf16_linear
from inferscale.models.weightmajor import in_a_batch
from test_avx2_linear import atens_avx2_build

F = torch.nn.functional
LAYERS = [(1536, 640), (640, 1024), (4096, 640), (640, 2048)]  # fused q/k/v, o, fused gate/up, down
# per kernel: the model's layer shapes and a slice of the LM head's rows (bf16_linear: with a ragged tail), and the
# row counts it takes (bf16_linear up to its MAX_ROWS; avx2_linear any: every register block, two row chunks)
CASES = {
    "bf16_linear": ([*LAYERS, (8192 + 7, 640)], (1, 2, 5, 8, 9, 12, 13, 15, 16, 17, 32, 64, bf16_linear.MAX_ROWS),
                    (2, 14, 16, 33, 64)),
    "avx2_linear": ([*LAYERS, (8192, 640)], (1, 2, 3, 4, 5, 6, 7, 13, 16, 17, 48, 49, 100), (2, 6, 7, 16, 48, 100)),
}
MODULES: dict[str, ModuleType] = {"bf16_linear": bf16_linear, "avx2_linear": avx2_linear}


@pytest.fixture(scope="module", params=list(CASES))
def kernel(request):
    if MODULES[request.param].load() is None:
        pytest.skip(f"{request.param} cannot run here, or could not be built")
    return request.param


def test_the_kernel_gives_f_linear_numbers_bit_for_bit(kernel):
    if kernel == "avx2_linear":
        atens_avx2_build()
    shapes, rows_counts, _ = CASES[kernel]
    product = MODULES[kernel].product
    for shape in shapes:
        gen = torch.Generator().manual_seed(shape[0])
        weight = torch.randn(*shape, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            for rows in rows_counts:
                x = (torch.randn(rows, shape[1], generator=gen) * rows).to(torch.bfloat16)
                out = product(weight, x)
                assert out.shape == (rows, shape[0]) and out.is_contiguous()
                assert torch.equal(out, in_a_batch(x, weight, None)), (kernel, shape, rows)


@pytest.mark.parametrize("in_features", [640, 1024, 2048])  # the model's: oneDNN sums a lone row of 2048 otherwise
def test_a_row_gets_the_same_numbers_whatever_rides_along(kernel, in_features):
    """A request decoded alone and the same request decoded beside others get the same numbers: a lone row too."""
    product = MODULES[kernel].product
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(1008, in_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(100, in_features, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([product(weight, x[i: i + 1]) for i in range(100)])
        for rows in CASES[kernel][2]:
            assert torch.equal(product(weight, x[:rows]), alone[:rows]), rows


def test_a_weight_written_in_place_is_packed_again(kernel):
    """The packed copy is kept on the weight; a write (a state dict loaded into the model) makes a new one."""
    product = MODULES[kernel].product
    weight = torch.randn(128, 64).to(torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    with torch.inference_mode():
        first = product(weight, x)
    with torch.no_grad():
        weight.mul_(2)
    with torch.inference_mode():
        assert torch.equal(product(weight, x), F.linear(x, weight)) and not torch.equal(product(weight, x), first)
