"""The TensorRT-LLM connector's plain-Python core on CPU: span planning, page alignment, cache salt, pool fill."""

import subprocess
import sys

import pytest
import torch

import tiny_models as tm
from inferscale.engine import MemoryItem
from inferscale.engine.cache import injected_cache, kv_of_cache
from inferscale.errors import ConfigError
from inferscale.kernels.rope import rope_shift
from inferscale.trtllm import InjectionEntry, PlanRegistry, cache_salt, fill_pool, plan_span, pool_view, salt_allows

SECRET = b"s" * 32


# ---- cache salt -----------------------------------------------------------------------------------------------
def test_salt_is_stable_per_tenant_and_distinct_across_tenants_and_secrets():
    a, b = cache_salt(SECRET, "tenant-a"), cache_salt(SECRET, "tenant-b")
    assert a == cache_salt(SECRET, "tenant-a")
    assert a != b
    assert a != cache_salt(b"t" * 32, "tenant-a")  # another deployment's salts differ
    assert "tenant-a" not in a and len(a) == 64


def test_salt_cannot_be_derived_without_the_secret():
    """A tenant who knows the scheme but not the secret cannot compute another tenant's salt (and so cannot
    join its reuse pool): the salt is an HMAC, not a hash of the name."""
    import hashlib

    salt = cache_salt(SECRET, "victim")
    for guess in (b"victim", b"inferscale/trtllm-cache-salt/v1\x00victim"):
        assert hashlib.sha256(guess).hexdigest() != salt


@pytest.mark.parametrize("tenant", ["", "Upper", "a/b", "x" * 64, "-lead"])
def test_salt_rejects_invalid_tenant(tenant):
    with pytest.raises(ConfigError):
        cache_salt(SECRET, tenant)


def test_salt_rejects_short_secret():
    with pytest.raises(ConfigError):
        cache_salt(b"short", "tenant-a")


def _salt_id(salt: str) -> int:
    """Stands in for TensorRT-LLM's salt → id hash (a plain function of the string; any stable hash will do)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def test_plan_is_used_only_by_requests_carrying_its_tenants_salt():
    """Attack: tenant B sends exactly tenant A's prompt token ids. The plan is found by token ids, but B's request
    carries B's salt, so it must not get A's injected KV."""
    plan_salt = cache_salt(SECRET, "tenant-a")
    assert salt_allows(plan_salt, _salt_id(plan_salt), _salt_id)
    assert not salt_allows(plan_salt, _salt_id(cache_salt(SECRET, "tenant-b")), _salt_id)
    assert not salt_allows(plan_salt, None, _salt_id)  # a request with no salt
    assert not salt_allows("", _salt_id(""), _salt_id)  # a plan registered without one


# ---- span planning --------------------------------------------------------------------------------------------
def test_plan_places_blocks_after_prefix_and_claims_whole_pages():
    plan = plan_span(10, [(7, 10), (13, 10)], 5, tokens_per_block=8)
    assert [(b.position, b.delta) for b in plan.blocks] == [(10, 0), (17, 7)]
    assert plan.memory_end == 30 and plan.total == 35
    assert plan.claim_end == 24  # 24..29 (a partial page) is prefilled with the question
    assert plan.num_new_matched_tokens(0) == 24
    assert plan.num_new_matched_tokens(8) == 16  # TensorRT-LLM already holds the first page
    assert plan.num_new_matched_tokens(5) == 0  # its match ends mid-page: pages are filled whole
    assert plan.num_new_matched_tokens(24) == 0
    assert plan.num_new_matched_tokens(32) == 0


def test_plan_always_leaves_a_token_to_prefill():
    plan = plan_span(8, [(8, 8)], 1, tokens_per_block=8)
    assert plan.claim_end == 16 < plan.total
    plan = plan_span(4, [(4, 4)], 1, tokens_per_block=8)
    assert plan.claim_end == 8 < plan.total


@pytest.mark.parametrize("args", [(10, [(0, 3)], 2, 8), (10, [(3, -1)], 2, 8), (10, [], 0, 8), (10, [], 2, 0)])
def test_plan_rejects_bad_input(args):
    with pytest.raises(ConfigError):
        plan_span(*args[:3], tokens_per_block=args[3])


def test_sources_map_tokens_to_positions_and_deltas():
    plan = plan_span(3, [(2, 100), (2, 3)], 1, tokens_per_block=1)
    tokens, positions, deltas = plan.sources(1, 7)
    assert tokens == positions == [1, 2, 3, 4, 5, 6]
    assert deltas == [0, 0, 3 - 100, 3 - 100, 5 - 3, 5 - 3]


# ---- pool fill ------------------------------------------------------------------------------------------------
def _inv_freq(theta, d):
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def test_fill_pool_writes_rotated_blocks_into_the_requests_pages_only():
    gen = torch.Generator().manual_seed(0)
    layers, heads, d, tpb = 3, 2, 16, 4
    prefix = torch.randn((layers, 2, heads, 6, d), generator=gen)
    blocks = [torch.randn((layers, 2, heads, n, d), generator=gen) for n in (5, 7)]
    plan = plan_span(6, [(5, 6), (7, 40)], 3, tokens_per_block=tpb)
    groups = [([0, 2], _inv_freq(1e4, d)), ([1], _inv_freq(1e6, d))]
    pool = torch.full((10, layers, 2, heads, tpb, d), float("nan"))
    pages = [7, 2, 9, 0, 5, 1]  # scattered, as TensorRT-LLM allocates them
    fill_pool(pool, pages, plan, prefix, blocks, groups, 4, plan.claim_end)  # first page already on device
    assert plan.claim_end == 16
    seq = torch.cat([prefix, *blocks], dim=3)
    for layer_ids, inv_freq in groups:
        for li in layer_ids:
            for p in range(16):
                page = pool[pages[p // tpb], li, :, :, p % tpb]
                if p < 4:
                    assert torch.isnan(page).all()  # TensorRT-LLM's own page: untouched
                    continue
                delta = next((b.delta for b in plan.blocks if b.position <= p < b.position + b.length), 0)
                want_k = rope_shift(seq[li, 0, :, p : p + 1], delta, inv_freq)[:, 0]
                assert torch.allclose(page[0], want_k, atol=1e-6)
                assert torch.equal(page[1], seq[li, 1, :, p])
    untouched = [i for i in range(10) if i not in pages[1:4]]
    assert torch.isnan(pool[untouched]).all()  # other requests' pages


def test_fill_pool_refuses_compact_codes():
    from inferscale.kvquant import quantize

    d, tpb = 16, 4
    prefix, block = torch.randn((1, 2, 1, 6, d)), torch.randn((1, 2, 1, 5, d))
    plan = plan_span(6, [(5, 6)], 3, tokens_per_block=tpb)
    pool = torch.zeros((4, 1, 2, 1, tpb, d))
    for fmt in ("int8", "fp8", "int4"):
        codes, _ = quantize(block, fmt)
        with pytest.raises(ConfigError, match="float_kv"):
            fill_pool(pool, [0, 1, 2], plan, prefix, [codes], [([0], _inv_freq(1e4, d))], 0, plan.claim_end)


def test_fill_pool_equals_engine_injection():
    """Pages filled by the connector hold exactly what the engine injects for the same prompt (tiny llama)."""
    engine = tm.engine("llama", sliding_window=None)
    items = [MemoryItem("m0", "caroline went to paris in may"), MemoryItem("m1", "melanie painted the beach")]
    blocks = engine.encode(items)
    prefix = engine.prefix_kv
    layout = engine.loaded.layout
    want = kv_of_cache(injected_cache(prefix, blocks, layout, engine.loaded.model.config, windowed=False))
    tpb = 4
    plan = plan_span(prefix.shape[3], [(b.num_tokens, b.start_pos) for b in blocks], 2, tokens_per_block=tpb)
    n_pages = (plan.total + tpb - 1) // tpb
    pool = torch.full((n_pages + 2, *want.shape[:3], tpb, want.shape[4]), float("nan"), dtype=want.dtype)
    pages = list(range(n_pages + 1, 1, -1))[:n_pages]
    fill_pool(pool, pages, plan, prefix, [b.kv for b in blocks], [tuple(g) for g in layout.freq_groups().values()],
              0, plan.claim_end)
    got = torch.stack([pool[pages[p // tpb], :, :, :, p % tpb] for p in range(plan.claim_end)], dim=3)
    assert (got - want[:, :, :, : plan.claim_end]).abs().max() < 1e-6


def test_fill_pool_rejects_unaligned_or_mismatched_input():
    prefix, block = torch.zeros((1, 2, 1, 4, 8)), torch.zeros((1, 2, 1, 4, 8))
    plan = plan_span(4, [(4, 4)], 1, tokens_per_block=4)
    pool = torch.zeros((4, 1, 2, 1, 4, 8))
    groups = [([0], _inv_freq(1e4, 8))]
    with pytest.raises(ConfigError):
        fill_pool(pool, [0, 1], plan, prefix, [block], groups, 2, 8)  # starts mid-page
    with pytest.raises(ConfigError):
        fill_pool(pool, [0, 1], plan, prefix, [], groups, 0, 8)  # a block missing
    with pytest.raises(ConfigError):
        fill_pool(pool, [0], plan, prefix, [block], groups, 0, 8)  # positions past the request's page table


def test_pool_view_of_trtllm_registered_tensor():
    flat = torch.arange(3 * 2 * 2 * (2 * 4 * 8), dtype=torch.float32).view(3, 2, 2, 2 * 4 * 8)
    v = pool_view(flat, 2, 8, 4)
    assert v.shape == (3, 2, 2, 2, 4, 8) and v.data_ptr() == flat.data_ptr()
    assert v[1, 0, 1, 1, 2, 3] == flat[1, 0, 1, 1 * 32 + 2 * 8 + 3]  # per page: heads, then tokens, then dim
    with pytest.raises(ConfigError):
        pool_view(flat, 3, 8, 4)


# ---- plans handed between processes ---------------------------------------------------------------------------
def test_plan_registry_round_trip(tmp_path):
    reg = PlanRegistry(tmp_path)
    entry = InjectionEntry(torch.randn(1, 2, 1, 3, 8), [torch.randn(1, 2, 1, 2, 8)], [3], [([0], _inv_freq(1e4, 8))],
                           salt=cache_salt(SECRET, "tenant-a"))
    reg.put([1, 2, 3], entry)
    got = reg.get([1, 2, 3])
    assert torch.equal(got.prefix_kv, entry.prefix_kv) and got.blocks == [(2, 3)] and got.groups[0][0] == [0]
    assert got.salt == entry.salt
    assert reg.get([1, 2, 4]) is None
    assert not list(tmp_path.glob("*.tmp"))


def test_plan_registry_needs_an_existing_directory(tmp_path):
    with pytest.raises(ConfigError):
        PlanRegistry(tmp_path / "missing")


# ---- imports --------------------------------------------------------------------------------------------------
def test_package_imports_without_tensorrt_llm():
    code = "import sys, inferscale.trtllm; assert 'tensorrt_llm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_adapter_needs_tensorrt_llm():
    """Without TensorRT-LLM (these machines) the adapter does not import; in a fresh interpreter, since other
    tests put the stand-in on sys.path for a while."""
    code = ("import importlib.util, sys\n"
            "if importlib.util.find_spec('tensorrt_llm'): sys.exit(77)\n"
            "try:\n    import inferscale.trtllm.connector\nexcept ImportError:\n    sys.exit(0)\nsys.exit(1)")
    rc = subprocess.run([sys.executable, "-c", code]).returncode
    if rc == 77:
        pytest.skip("tensorrt_llm is installed: scripts/gpu-check.sh exercises the adapter")
    assert rc == 0


def test_fill_pool_through_the_triton_kernel_equals_torch(monkeypatch):
    """The connector's fill with the kernel it uses on GPU (here under Triton's interpreter) gives the torch
    path's pages, NaN-poisoned pool and all."""
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    import inferscale.trtllm.core as core
    from inferscale.kernels.inject_triton import inject_triton

    gen = torch.Generator().manual_seed(5)
    layers, heads, d, tpb = 2, 2, 32, 4
    prefix = torch.randn((layers, 2, heads, 5, d), generator=gen)
    blocks = [torch.randn((layers, 2, heads, n, d), generator=gen) for n in (6, 9)]
    plan = plan_span(5, [(6, 5), (9, 70)], 2, tokens_per_block=tpb)
    groups = [([0], _inv_freq(1e4, d)), ([1], _inv_freq(1e6, d))]
    pages = [4, 1, 6, 0, 2]
    want = torch.full((8, layers, 2, heads, tpb, d), float("nan"), dtype=torch.bfloat16)
    fill_pool(want, pages, plan, prefix, blocks, groups, 0, plan.claim_end)
    monkeypatch.setattr(core, "shift_and_place", inject_triton)
    got = torch.full_like(want, float("nan"))
    fill_pool(got, pages, plan, prefix, blocks, groups, 0, plan.claim_end)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    filled = ~torch.isnan(want)
    assert filled.any() and float((got[filled].float() - want[filled].float()).abs().max()) <= 1e-3
