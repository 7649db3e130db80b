"""A kv request's blocks into its slot in one pass (``kernels/rotate_place.cpp``, issue 22): the torch path's slot
contents bit for bit, a clear error on what it cannot take, the torch path kept where it is off. Skipped (except the
switch) where the extension cannot be built here."""

from __future__ import annotations

import pytest
import torch

from inferscale.kernels import rotate_place

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def kernel():
    op = rotate_place.load()
    if op is None:
        pytest.skip("rotate_place.cpp not built here, or its keys differ from the torch path's: torch injects")
    return op


def _slots(layers: int, heads: int, dim: int, capacity: int = 700) -> list[torch.Tensor]:
    return [torch.zeros(4, heads, capacity, dim, dtype=BF16) for _ in range(layers)]


@pytest.mark.parametrize("heads,dim", [(1, 256), (2, 128), (4, 64), (1, 2)])
def test_slots_hold_the_torch_paths_bits(kernel, heads, dim):
    """Twenty blocks of Gemma-like sizes behind a prefix taken from a skip (a sliding group's window), Δ from
    negative to 10^5, every third layer, keys of several magnitudes (rotation rounds differently at each)."""
    gen = torch.Generator().manual_seed(dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    lengths = torch.randint(4, 40, (20,), generator=gen).tolist()
    sources = [(torch.randn(9, 2, heads, 60, dim, generator=gen) * 3).to(BF16)]
    sources += [(torch.randn(9, 2, heads, n, dim, generator=gen) * s).to(BF16)
                for n, s in zip(lengths, [1e-3, 1.0, 50.0, 7.0] * 5)]
    skips = [13, 3] + [0] * 19
    deltas = [None] + torch.randint(-300, 2000, (19,), generator=gen).tolist() + [100_000]
    layers = [0, 3, 6]
    got = (_slots(len(layers), heads, dim), _slots(len(layers), heads, dim))
    want = tuple([t.clone() for t in kv] for kv in got)
    cos, sin = rotate_place.rotations(deltas[1:], inv_freq)
    kernel(got[0], got[1], 2, 5, sources, skips, layers, cos, sin, 1)
    rotate_place.reference(want[0], want[1], 2, 5, sources, skips, layers, deltas, inv_freq)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)
    assert got[0][0][2, :, 5:5 + 47].abs().sum() > 0  # the prefix's kept tokens landed at `start`
    assert got[0][0][:2].abs().sum() == 0 and got[0][0][3].abs().sum() == 0  # other slots untouched


def test_sources_read_in_place_from_strided_views(kernel):
    """A block's K/V may be a view (a tier's staging buffer sliced along tokens): the same slot contents."""
    gen = torch.Generator().manual_seed(3)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    wide = torch.randn(3, 2, 1, 50, 64, generator=gen).to(BF16)
    view = wide[:, :, :, 10:30]
    a, b = (_slots(3, 1, 64), _slots(3, 1, 64)), (_slots(3, 1, 64), _slots(3, 1, 64))
    cos, sin = rotate_place.rotations([17], inv_freq)
    kernel(a[0], a[1], 0, 0, [view], [0], [0, 1, 2], cos, sin, 0)
    kernel(b[0], b[1], 0, 0, [view.contiguous()], [0], [0, 1, 2], cos, sin, 0)
    assert all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))


@pytest.mark.parametrize("bad,message", [
    ("capacity", "past the capacity"),
    ("dtype", "sources must be bf16"),
    ("cos_rows", "cos and sin must be float32"),
    ("layer", "not in a source"),
    ("slot", "bad slot"),
])
def test_what_it_cannot_take_is_a_clear_error(kernel, bad, message):
    inv_freq = torch.ones(32)
    src = torch.zeros(4, 2, 1, 10, 64, dtype=BF16)
    keys, values, slot, layers = _slots(2, 1, 64, capacity=16), _slots(2, 1, 64, capacity=16), 0, [0, 1]
    cos, sin = rotate_place.rotations([3], inv_freq)
    if bad == "capacity":
        src = torch.zeros(4, 2, 1, 17, 64, dtype=BF16)
    elif bad == "dtype":
        src = src.float()
    elif bad == "cos_rows":
        cos, sin = rotate_place.rotations([3, 4], inv_freq)
    elif bad == "layer":
        layers = [0, 4]
    else:
        slot = 4
    with pytest.raises(RuntimeError, match=message):
        kernel(keys, values, slot, 0, [src], [0], layers, cos, sin, 0)


def test_switched_off_it_is_not_loaded(monkeypatch):
    monkeypatch.setenv("INFERSCALE_ROTATE_PLACE", "0")
    rotate_place.load.cache_clear()
    try:
        assert rotate_place.load() is None
    finally:
        monkeypatch.delenv("INFERSCALE_ROTATE_PLACE")
        rotate_place.load.cache_clear()
