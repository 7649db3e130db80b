"""``inferscale plan``'s node simulation predicts what the real store does: the same Zipf trace through a real
``KVStore`` (its DRAM tier, its BlockCache) and through ``capacity.simulate`` at the same DRAM budget gives the
same DRAM hit rate, to within the sketch's hash collisions (the keys differ: store keys vs (user, memory))."""

from __future__ import annotations

import sys
from pathlib import Path

from inferscale.capacity import simulate
from inferscale.bench.replay import NO_RECOMPUTE_TOKENS_S, ReplayConfig
from inferscale.store import KVStore
from inferscale.store.arena import align_up

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from store.helpers import FP, make_block  # noqa: E402


def test_simulated_dram_hit_rate_matches_the_real_store(tmp_path):
    cfg = ReplayConfig(users=8, memories=24, k=3, requests=300, dram_fraction=0.15)
    trace = cfg.trace()
    with KVStore(tmp_path, dram_budget_bytes=1 << 30, nixl=False, min_block_bytes=1) as loader:
        for u, n in enumerate(trace.memories):
            for i in range(int(n)):
                loader.put("t", f"u{u}", make_block(f"m{i:04d}", embed=False), cache=False)
        size = align_up(loader.list("t", "u0")[0].size)
    budget = int(size * int(trace.memories.sum()) * cfg.dram_fraction)
    warmup = len(trace.requests) // 3
    hits = misses = 0
    with KVStore(tmp_path, dram_budget_bytes=budget, nixl=False, min_block_bytes=1) as store:
        for n, req in enumerate(trace.requests):
            _, st = store.get_many("t", f"u{req.user}", [f"m{i:04d}" for i in req.blocks], FP)
            if n >= warmup:
                hits, misses = hits + st.tiers["dram"], misses + st.tiers["disk"]
        assert store.stats()["dram_rejected"] > 0  # the filter was at work, not only free room
    node = simulate.NodeShape(hbm_bytes=0, dram_bytes=budget, disk_bytes=1 << 50, dram_gbs=10, disk_gbs=1,
                              dram_fixed_s=0, disk_fixed_s=0, prefill_tokens_s=NO_RECOMPUTE_TOKENS_S)
    sim = simulate.per_block(trace, node, block_bytes=size, block_tokens=4, scale=1.0, question_tokens=0,
                             warmup=warmup)
    real = hits / (hits + misses)
    predicted = sim.served["dram"] / (sim.served["dram"] + sim.served["disk"])
    assert 0.2 < real < 0.9
    assert abs(real - predicted) <= 0.02, (real, predicted)
