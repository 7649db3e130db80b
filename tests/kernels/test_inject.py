"""The fused Triton injection kernel equals the torch reference, on fresh random inputs, in both cache layouts.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported); on a
CUDA machine with TRITON_INTERPRET=0 (scripts/gpu-check.sh) the same tests run the compiled kernel on the GPU.
Every output buffer is poisoned with NaN first, so a position the kernel skips, or writes outside the plan, shows.
"""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from inferscale.errors import ConfigError  # noqa: E402
from inferscale.kernels import inject  # noqa: E402
from inferscale.kernels.inject import inject_reference, rotate_in_place, shift_and_place  # noqa: E402
from inferscale.kernels.inject_triton import inject_triton  # noqa: E402
from inferscale.kernels.rope import rope_shift  # noqa: E402

COMPILED = os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if COMPILED else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def _inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def _plan(gen, prefix_len: int, block_lens: list[int], window: int | None, sign: int):
    """What engine/cache.py asks for: [prefix][blocks], each block encoded at its own start_pos and moved to where
    it now sits; a sliding window keeps only the last window-1 positions. Returns src token, position, Δ lists
    and the sequence length."""
    n = prefix_len + sum(block_lens)
    keep_from = max(0, n - (window - 1)) if window else 0
    src_tokens, positions, deltas = [], [], []
    src_at, pos = 0, 0
    for i, length in enumerate([prefix_len, *block_lens]):
        # The prefix never moves; a block was encoded right after the prefix (or, with sign < 0, far later).
        delta = 0 if i == 0 else sign * int(torch.randint(1, 3000, (1,), generator=gen))
        for t in range(length):
            if pos + t >= keep_from:
                src_tokens.append(src_at + t)
                positions.append(pos + t)
                deltas.append(delta)
        src_at += length
        pos += length
    return src_tokens, positions, deltas, n


def _src(gen, layers, heads, tokens, head_dim, dtype):
    x = torch.randn((layers, 2, heads, tokens, head_dim), generator=gen) * 3
    if dtype == torch.int8:
        q = torch.randint(-127, 128, x.shape, generator=gen, dtype=torch.int8)
        return q
    return x.to(dtype)


def _check(out, ref, dtype, touched_mask):
    tol = TOL[dtype]
    assert not torch.isnan(ref[touched_mask]).any(), "reference left a planned position unwritten"
    assert torch.isnan(out[~touched_mask]).all(), "kernel wrote outside the plan"
    got, want = out[touched_mask].float(), ref[touched_mask].float()
    assert not torch.isnan(got).any(), "kernel left a planned position unwritten"
    diff = (got - want).abs()
    # Compiled, the kernel runs without FMA contraction (enable_fp_fusion=False), so the GPU rounds as the
    # reference does: the same bound holds compiled and interpreted.
    assert float(diff.max()) <= tol, float(diff.max())


CASES = [
    # theta, head_dim, heads, block lengths, window, delta sign, src dtype, dst dtype
    (1e4, 64, 2, [7, 13, 1], None, 1, torch.float32, torch.float32),
    (1e6, 128, 1, [5, 9], None, -1, torch.float32, torch.float32),
    (1e4, 64, 2, [11, 3, 17], 9, 1, torch.bfloat16, torch.bfloat16),
    (1e6, 64, 3, [30, 1], None, -1, torch.bfloat16, torch.bfloat16),
    (1e4, 128, 2, [4, 4, 4, 4, 4], 6, -1, torch.float16, torch.float16),
    (1e6, 80, 2, [19], None, 1, torch.bfloat16, torch.float32),  # head_dim not a power of two: masked halves
    (1e4, 64, 2, [6, 15], None, 1, torch.int8, torch.bfloat16),  # int8 + per-token scale (compact blocks)
    (1e6, 64, 1, [9, 2], 5, -1, torch.int8, torch.float32),  # int8 + per-channel scale, windowed
]


def _scale(gen, src_dtype, layers, heads, tokens, head_dim, case_idx):
    if src_dtype != torch.int8:
        return None
    if case_idx % 2 == 0:  # per token and head
        return torch.rand((layers, 2, heads, tokens, 1), generator=gen) / 64 + 1e-3
    return torch.rand((layers, 2, heads, 1, head_dim), generator=gen) / 64 + 1e-3  # per channel


@pytest.mark.parametrize("layout", ["cache", "paged"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_matches_reference(case, layout):
    theta, head_dim, heads, block_lens, window, sign, src_dtype, dst_dtype = CASES[case]
    gen = torch.Generator().manual_seed(1000 * case + (layout == "paged"))  # fresh inputs per case
    prefix_len, layers = 5, 4
    group = [0, 2, 3]  # a layer group need not be consecutive (Gemma-3: 5 sliding, 1 full)
    src_tokens, positions, deltas, n = _plan(gen, prefix_len, block_lens, window, sign)
    src = _src(gen, layers, heads, prefix_len + sum(block_lens), head_dim, src_dtype)
    scale = _scale(gen, src_dtype, layers, heads, src.shape[3], head_dim, case)
    kw = dict(src_layers=group, dst_layers=[0, 1, 2], src_tokens=src_tokens, dst_positions=positions,
              deltas=deltas, inv_freq=_inv_freq(theta, head_dim), scale=scale)
    if layout == "cache":
        shape = (len(group), 2, heads, n + 3, head_dim)  # 3 spare positions must stay untouched
        touched = torch.zeros(shape, dtype=torch.bool)
        touched[:, :, :, positions] = True
    else:
        tpp = 8
        pages = (n + tpp - 1) // tpp
        pool_pages = pages + 3
        page_table = torch.randperm(pool_pages, generator=gen)[:pages].tolist()  # scattered pool pages
        kw.update(page_table=page_table, tokens_per_page=tpp)
        shape = (pool_pages, layers + 1, 2, heads, tpp, head_dim)  # more pool layers than the group writes
        touched = torch.zeros(shape, dtype=torch.bool)
        for p in positions:
            touched[page_table[p // tpp], :3, :, :, p % tpp] = True
    ref = inject_reference(src, torch.full(shape, float("nan"), dtype=dst_dtype), **kw)
    dev_kw = dict(kw, scale=None if scale is None else scale.to(DEVICE))
    out = inject_triton(src.to(DEVICE), torch.full(shape, float("nan"), dtype=dst_dtype, device=DEVICE), **dev_kw)
    _check(out.cpu(), ref, dst_dtype, touched)


def test_reference_paged_equals_cache_layout():
    """The oracle's two layouts agree with each other: page addressing is checked independently of the kernel."""
    gen = torch.Generator().manual_seed(7)
    src_tokens, positions, deltas, n = _plan(gen, 3, [5, 11], None, 1)
    src = _src(gen, 2, 2, 19, 64, torch.float32)
    kw = dict(src_layers=[0, 1], dst_layers=[0, 1], src_tokens=src_tokens, dst_positions=positions, deltas=deltas,
              inv_freq=_inv_freq(1e4, 64))
    flat = inject_reference(src, torch.zeros((2, 2, 2, n, 64)), **kw)
    table = [3, 0, 2]
    pool = inject_reference(src, torch.zeros((4, 2, 2, 2, 8, 64)), page_table=table, tokens_per_page=8, **kw)
    for p in range(n):
        assert torch.equal(pool[table[p // 8], :, :, :, p % 8], flat[:, :, :, p])
    # and the keys are the rotation rope_shift gives, values untouched
    assert torch.equal(flat[:, 1], src[:, 1, :, src_tokens])
    torch.testing.assert_close(flat[:, 0], rope_shift(src[:, 0, :, src_tokens], torch.tensor(deltas),
                                                      _inv_freq(1e4, 64)), rtol=0, atol=0)


def test_rotate_in_place_matches_rope_shift_and_leaves_values():
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn((2, 2, 2, 20, 64), generator=gen).to(DEVICE)
    delta = torch.randint(-500, 500, (12,), generator=gen)
    want = kv.clone()
    rope_shift(want[:, 0, :, 8:], delta, _inv_freq(1e4, 64), inplace=True)
    rotate_in_place(kv, 8, delta, _inv_freq(1e4, 64))
    assert float((kv - want).abs().max()) <= 1e-5


def test_cpu_tensors_take_the_torch_path(monkeypatch):
    """The engine's CPU path must not depend on the kernel: selection looks at the device."""
    import inferscale.kernels.inject_triton as kt

    monkeypatch.setattr(kt, "inject_triton", lambda *a, **k: (_ for _ in ()).throw(AssertionError("triton on CPU")))
    src = torch.randn((1, 2, 1, 4, 8))
    out = shift_and_place(src, torch.zeros((1, 2, 1, 4, 8)), src_layers=[0], dst_layers=[0], src_tokens=[0, 1, 2, 3],
                          dst_positions=[0, 1, 2, 3], deltas=[0, 0, 0, 0], inv_freq=_inv_freq(1e4, 8))
    assert torch.equal(out, src)


@pytest.mark.parametrize("bad", [
    dict(dst_positions=[0, 1, 99]),  # past the end of the cache
    dict(src_tokens=[0, 1, -1]),  # negative index
    dict(src_layers=[5]),  # layer the source does not have
    dict(inv_freq=_inv_freq(1e4, 16)),  # θ table for another head_dim
])
@pytest.mark.parametrize("impl", [inject_reference, inject_triton])
def test_bad_plan_is_a_config_error(impl, bad):
    kw = dict(src_layers=[0], dst_layers=[0], src_tokens=[0, 1, 2], dst_positions=[0, 1, 2], deltas=[1, 1, 1],
              inv_freq=_inv_freq(1e4, 8))
    kw.update(bad)
    with pytest.raises(ConfigError):
        impl(torch.zeros((1, 2, 1, 3, 8)), torch.zeros((1, 2, 1, 3, 8)), **kw)


def test_paged_plan_outside_the_page_table_is_a_config_error():
    kw = dict(src_layers=[0], dst_layers=[0], src_tokens=[0, 1], dst_positions=[0, 9], deltas=[0, 0],
              inv_freq=_inv_freq(1e4, 8), page_table=[1], tokens_per_page=4)
    with pytest.raises(ConfigError):
        inject.inject_reference(torch.zeros((1, 2, 1, 2, 8)), torch.zeros((2, 1, 2, 1, 4, 8)), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_in_place_rotation_is_what_the_engine_gets_on_cuda(dtype):
    """rotate_in_place on CUDA runs the kernel with src = dst and values left alone: checked here directly."""
    gen = torch.Generator().manual_seed(11)
    kv = (torch.randn((3, 2, 2, 21, 64), generator=gen) * 2).to(dtype)
    delta = torch.randint(-900, 900, (13,), generator=gen)
    inv_freq = _inv_freq(1e6, 64)
    want = kv.clone()
    rope_shift(want[:, 0, :, 8:], delta, inv_freq, inplace=True)
    got = kv.to(DEVICE)
    tokens = list(range(8, 21))
    inject_triton(got, got, src_layers=[0, 1, 2], dst_layers=[0, 1, 2], src_tokens=tokens, dst_positions=tokens,
                  deltas=delta, inv_freq=inv_freq, move_values=False)
    got = got.cpu()
    assert torch.equal(got[:, 1], kv[:, 1]) and torch.equal(got[:, 0, :, :8], kv[:, 0, :, :8])
    assert float((got.float() - want.float()).abs().max()) <= TOL[dtype]
