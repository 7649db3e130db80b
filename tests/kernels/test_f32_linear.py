"""Float32 linears of a few rows (``kernels/f32_linear.cpp``, issue 22: the retrieval embedder's query): error against
float64 no larger than aten's, each row independent of the others, a clear error on what it cannot take, aten's
product past MAX_ROWS and where it is off. Skipped (except the switch) where the extension cannot be built here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inferscale.kernels import f32_linear


@pytest.fixture(scope="module")
def ops():
    loaded = f32_linear.load()
    if loaded is None:
        pytest.skip("f32_linear.cpp not built here, or its error exceeds aten's: aten's linears are used")
    return loaded


@pytest.mark.parametrize("out,inp", [(384, 384), (1536, 384), (384, 1536), (17, 70), (1, 129), (33, 1)])
def test_error_is_within_float32_summations_bound_and_no_larger_than_atens(ops, out, inp):
    """Every output within the bound any float32 summation order obeys ((in + 1) 2^-24 sum |w x| + |b| 2^-24); on
    MiniLM's shapes, whose many outputs make the max a stable statistic, no larger than ERROR_RATIO times aten's."""
    pack, product = ops
    gen = torch.Generator().manual_seed(out * inp)
    w, b = torch.randn(out, inp, generator=gen) * inp ** -0.5, torch.randn(out, generator=gen)
    for rows in (1, 2, 5, 6, 7, 23, 64, 256):
        x = torch.randn(rows, inp, generator=gen) * 3
        exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
        got = product(pack(w), x, b, out)
        assert got.shape == (rows, out)
        err = (got.double() - exact).abs()
        bound = (inp + 1) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T + b.double().abs())
        assert (err <= bound).all(), rows
        if out * rows >= 384 * 6:
            aten = (torch.nn.functional.linear(x, w, b).double() - exact).abs().max()
            assert err.max() <= f32_linear.ERROR_RATIO * aten + 1e-7, rows


def test_a_row_gets_the_same_bits_alone_and_in_any_batch(ops):
    """A query embedded alone or with the other queries of its tenant's batch: its rows' products are the same."""
    pack, product = ops
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1536, 384, generator=gen)
    packed = pack(w)
    x = torch.randn(29, 384, generator=gen)
    together = product(packed, x, None, 1536)
    for r in (0, 5, 6, 28):
        assert torch.equal(product(packed, x[r:r + 1], None, 1536), together[r:r + 1])
    assert torch.equal(product(packed, x[3:17], None, 1536), together[3:17])


@pytest.mark.parametrize("bad,message", [
    ("unpacked", "packed by f32_pack"),
    ("width", "x must be float32"),
    ("dtype", "x must be float32"),
    ("out", "does not match the packed weight"),
    ("bias", "bias must be float32"),
])
def test_what_it_cannot_take_is_a_clear_error(ops, bad, message):
    pack, product = ops
    w = torch.randn(40, 64)
    packed, x, bias, out = pack(w), torch.randn(3, 64), torch.randn(40), 40
    if bad == "unpacked":
        packed = w
    elif bad == "width":
        x = torch.randn(3, 65)
    elif bad == "dtype":
        x = x.double()
    elif bad == "out":
        out = 60
    else:
        bias = torch.randn(41)
    with pytest.raises(RuntimeError, match=message):
        product(packed, x, bias, out)


def test_install_puts_the_kernel_under_a_models_linears_for_short_passes(ops):
    gen = torch.Generator().manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 16, bias=False))
    reference = [torch.nn.Linear(64, 96), torch.nn.Linear(96, 16, bias=False)]
    reference[0].load_state_dict(model[0].state_dict())
    reference[1].load_state_dict(model[2].state_dict())
    assert f32_linear.install(model) == 2 and isinstance(model[0], f32_linear.PackedLinear)
    with torch.inference_mode():
        short = torch.randn(2, 9, 64, generator=gen)  # 18 rows: the kernel's
        want = reference[1](torch.nn.functional.gelu(reference[0](short)))
        assert torch.allclose(model(short), want, atol=1e-5)
        long = torch.randn(f32_linear.MAX_ROWS + 1, 64, generator=gen)  # past MAX_ROWS: aten's bits
        assert torch.equal(model(long), reference[1](torch.nn.functional.gelu(reference[0](long))))
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight"}  # the packing is not saved


TESTS = str(Path(__file__).parents[1])  # os_threads.py
PINNED_SIDE_THREAD = """
import concurrent.futures, torch
from os_threads import os_threads  # the load thread's OpenMP workers leave after it is joined: counted once gone
from inferscale.engine.threads import on_own_thread, pin_threads, configure_threads
from inferscale.kernels import f32_linear
configure_threads(None)
pack, product = on_own_thread(f32_linear.load)  # as the server builds its embedder
packed, x = pack(torch.randn(384, 384)), torch.randn(23, 384)
side = concurrent.futures.ThreadPoolExecutor(1, initializer=pin_threads, initargs=(1,))
side.submit(torch.get_num_threads).result()
before = os_threads()
side.submit(product, packed, x, None, 384).result()
print(before, os_threads())
"""


def test_a_side_thread_pinned_to_one_core_keeps_no_openmp_pool(ops):
    """The server's side threads run the embedder's products on their one core: no pool of worker threads stays
    behind (through at::parallel_for, the extension's first call on such a thread reset its count to torch's and
    left one: a third OpenMP thread on two cores, a decode step 22-26 -> 32-39 ms through the server)."""
    run = subprocess.run([sys.executable, "-c", PINNED_SIDE_THREAD], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": TESTS})
    assert run.returncode == 0, run.stderr[-2000:]
    before, after = map(int, run.stdout.split()[-2:])
    assert after == before


def test_switched_off_it_is_not_loaded(monkeypatch):
    monkeypatch.setenv("INFERSCALE_F32_LINEAR", "0")
    f32_linear.load.cache_clear()
    try:
        assert f32_linear.load() is None
        assert f32_linear.install(torch.nn.Sequential(torch.nn.Linear(4, 4))) == 0
    finally:
        monkeypatch.delenv("INFERSCALE_F32_LINEAR")
        f32_linear.load.cache_clear()
