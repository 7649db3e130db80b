"""The per-block cache policy (inferscale/store/blockcache.py): frequency-filtered admission, byte budgets,
tenant shares and pins. No torch, no clock."""

from __future__ import annotations

import pytest

from inferscale.errors import ConfigError
from inferscale.store.blockcache import BlockCache, FrequencySketch

MB = 1 << 20


def touch(cache: BlockCache, key, tenant: str = "a", size: int = MB, times: int = 1) -> bool:
    """A read that misses brings the block up and offers it, as a tier does; True when resident afterwards."""
    for _ in range(times):
        if not cache.lookup(key, size):
            cache.admit(key, tenant, size)
    return key in cache


def test_sketch_counts_and_halves():
    s = FrequencySketch(64)
    for _ in range(5):
        s.add("hot")
    s.add("cold")
    assert s.estimate("hot") >= 5 and s.estimate("cold") >= 1 and s.estimate("never") <= 1
    for _ in range(s.sample):  # enough reads of another key to trigger the periodic halving
        s.add("other")
    assert s.estimate("hot") <= 3  # old popularity fades


def test_one_touch_block_does_not_push_out_a_hot_one():
    cache = BlockCache(budget_bytes=4 * MB)
    for k in range(4):
        touch(cache, ("hot", k), times=5)
    for k in range(50):  # a scan of blocks read once each
        touch(cache, ("scan", k))
    assert all(("hot", k) in cache for k in range(4))
    assert cache.stats.rejected == 50 and cache.used_bytes <= 4 * MB


def test_plain_lru_lets_the_scan_flush_the_hot_set():
    """The same trace without the filter: what whole-user LRU does today (the contrast the filter exists for)."""
    cache = BlockCache(budget_bytes=4 * MB, frequency_filter=False)
    for k in range(4):
        touch(cache, ("hot", k), times=5)
    for k in range(50):
        touch(cache, ("scan", k))
    assert not any(("hot", k) in cache for k in range(4))


def test_a_block_that_turns_hot_gets_in():
    cache = BlockCache(budget_bytes=2 * MB)
    touch(cache, "x", times=2)
    touch(cache, "y", times=2)
    assert not touch(cache, "z")  # once: refused
    assert touch(cache, "z", times=3)  # asked again and again: more frequent than the LRU victim
    assert cache.stats.evicted == 1


def test_byte_budget_counts_sizes():
    cache = BlockCache(budget_bytes=10 * MB)
    touch(cache, "big", size=6 * MB, times=3)
    touch(cache, "small", size=3 * MB, times=3)
    assert cache.used_bytes == 9 * MB
    assert not cache.admit("huge", "a", 11 * MB).admitted  # larger than the tier
    assert cache.stats.hit_bytes == 2 * 6 * MB + 2 * 3 * MB


def test_tenant_over_its_share_evicts_only_its_own():
    cache = BlockCache(budget_bytes=4 * MB, default_share=2 * MB)
    touch(cache, "b1", tenant="b", times=2)
    touch(cache, "b2", tenant="b", times=2)
    touch(cache, "a1", tenant="a", times=2)
    touch(cache, "a2", tenant="a", times=2)
    for k in range(4):  # tenant a churns through ever hotter blocks of its own
        assert touch(cache, ("a", k), tenant="a", times=3 + 3 * k)
    assert "b1" in cache and "b2" in cache  # b's blocks stay: a may not evict beyond its share
    assert cache.tenant_bytes("a") <= 2 * MB


def test_within_its_share_a_tenant_may_evict_others():
    cache = BlockCache(budget_bytes=2 * MB, default_share=1 * MB, tenant_shares={"b": None})
    touch(cache, "b1", tenant="b", times=2)
    touch(cache, "b2", tenant="b", times=2)
    assert touch(cache, "a1", tenant="a", times=5)
    assert cache.tenant_bytes("b") == MB


def test_pinned_blocks_are_never_evicted():
    cache = BlockCache(budget_bytes=2 * MB)
    touch(cache, "p", times=1)
    touch(cache, "q", times=1)
    cache.pin("p")
    cache.pin("q")
    assert not touch(cache, "r", times=9)  # everything resident is pinned: refused, nothing moves
    cache.unpin("q")
    assert touch(cache, "r", times=9)
    assert "p" in cache and "q" not in cache
    with pytest.raises(ConfigError):
        cache.unpin("q")


def test_discard_frees_without_counting_an_eviction():
    cache = BlockCache(budget_bytes=2 * MB)
    touch(cache, "x")
    assert cache.discard("x") and not cache.discard("x")
    assert cache.used_bytes == 0 and cache.stats.evicted == 0


def test_bad_sizes_are_typed_errors():
    with pytest.raises(ConfigError):
        BlockCache(budget_bytes=-1)
    with pytest.raises(ConfigError):
        BlockCache(budget_bytes=MB).admit("x", "a", -5)
