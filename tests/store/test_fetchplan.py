"""The fetch-or-recompute planner (inferscale/store/fetchplan.py): costs learned online from observed transfers,
and the plan following them when a tier slows down and recovers."""

from __future__ import annotations

import pytest

from inferscale.errors import ConfigError
from inferscale.store.fetchplan import FetchPlanner, LinearCost, PlanBlock

GB = 1e9
TOKENS = 30  # one memory
BYTES = TOKENS * 131_072  # 8B bf16
PREFILL = 30_000.0  # tokens/s: break-even link = 131072 × 30000 ≈ 3.9 GB/s


def planner(disk_gbs: float = 12.0, overlap: bool = True) -> FetchPlanner:
    return FetchPlanner(tiers={"dram": LinearCost(rate=50 * GB, fixed_s=10e-6),
                               "disk": LinearCost(rate=disk_gbs * GB, fixed_s=50e-6)},
                        prefill=LinearCost(rate=PREFILL), overlap=overlap)


def transfers(p: FetchPlanner, tier: str, gbs: float, fixed_s: float, n: int = 40) -> None:
    """What the store would report after ``n`` real reads of one or a few blocks from ``tier`` at that speed."""
    for i in range(n):
        nbytes = BYTES * (1 + i % 3)
        p.observe_transfer(tier, nbytes, fixed_s + nbytes / (gbs * GB))


def blocks(tier: str, n: int = 10) -> list[PlanBlock]:
    return [PlanBlock((tier, i), tier, BYTES, TOKENS) for i in range(n)]


def test_linear_cost_learns_rate_and_fixed_cost():
    c = LinearCost(rate=1 * GB, fixed_s=0.0)
    for nbytes in (1e6, 4e6, 16e6, 2e6, 8e6):
        c.observe(nbytes, 100e-6 + nbytes / (7 * GB))
    assert c.rate == pytest.approx(7 * GB, rel=1e-6)
    assert c.fixed_s == pytest.approx(100e-6, rel=1e-6)


def test_linear_cost_with_one_size_keeps_the_prior_fixed_cost():
    c = LinearCost(rate=1 * GB, fixed_s=50e-6)
    for _ in range(5):
        c.observe(BYTES, 50e-6 + BYTES / (3 * GB))
    assert c.rate == pytest.approx(3 * GB, rel=1e-6) and c.fixed_s == 50e-6


def test_a_transfer_faster_than_the_prior_fixed_cost_is_learned():
    """A recovered tier whose first fast read takes less than the prior fixed cost: the fit drops that fixed cost
    instead of ignoring the observation (which would keep the tier slow forever)."""
    c = LinearCost(rate=1e3, fixed_s=100e-6)  # learned slow: 1 kB/s
    c.observe(4096, 40e-6)
    assert c.predict(4096) == pytest.approx(40e-6) and c.fixed_s == 0.0


def test_disk_throttled_below_break_even_recomputes_and_fast_again_fetches():
    p = planner()
    transfers(p, "disk", 25.0, 50e-6)
    fast = p.plan(blocks("disk"), question_tokens=128)
    assert fast.fetch == {"disk": tuple(b.key for b in blocks("disk"))} and fast.recompute == ()

    transfers(p, "disk", 0.05, 50e-6)  # the disk is throttled to 50 MB/s, far below break-even
    slow = p.plan(blocks("disk"), question_tokens=128)
    assert slow.fetch == {} and len(slow.recompute) == 10 and slow.recomputed_tokens == 300
    every_fetch = sum(p.fetch_cost(b) for b in blocks("disk"))
    assert slow.predicted_s < every_fetch  # recomputing beats what fetching would have cost

    transfers(p, "disk", 25.0, 50e-6)  # fast again: the decayed fit follows
    again = p.plan(blocks("disk"), question_tokens=128)
    assert again.recompute == () and len(again.fetch["disk"]) == 10


def test_throttled_disk_leaves_dram_and_device_blocks_fetched():
    p = planner()
    transfers(p, "disk", 0.05, 50e-6)
    mixed = blocks("gpu", 2) + blocks("dram", 3) + blocks("disk", 5)
    plan = p.plan(mixed, question_tokens=128)
    assert len(plan.fetch["gpu"]) == 2 and len(plan.fetch["dram"]) == 3
    assert set(plan.recompute) == {("disk", i) for i in range(5)}


def test_overlap_splits_work_between_link_and_compute():
    """A link near break-even: with overlap the planner fetches some and recomputes the others at the same time,
    which beats both all-fetch and all-recompute; without overlap each block takes its cheaper path."""
    p = planner(disk_gbs=3.9)
    plan = p.plan(blocks("disk"), question_tokens=0)
    all_fetch = sum(p.fetch_cost(b) for b in blocks("disk"))
    all_compute = p.compute_cost(10 * TOKENS)
    assert plan.fetch and plan.recompute
    assert plan.predicted_s < min(all_fetch, all_compute)
    assert plan.predicted_s == pytest.approx(max(plan.fetch_s, plan.compute_s))

    serial = planner(disk_gbs=3.9, overlap=False).plan(blocks("disk"), question_tokens=0)
    assert serial.predicted_s == pytest.approx(serial.fetch_s + serial.compute_s)


def test_plan_attributes_name_tiers_and_prediction():
    p = planner()
    attrs = p.plan(blocks("dram", 2), question_tokens=10).as_attributes()
    assert attrs["kv.plan.tier.dram"] == 2 and attrs["kv.plan.recomputed_tokens"] == 0
    assert attrs["kv.plan.predicted_s"] > 0


def test_unknown_tier_and_bad_models_are_config_errors():
    with pytest.raises(ConfigError, match="peer"):
        planner().plan(blocks("peer", 1))
    with pytest.raises(ConfigError):
        LinearCost(rate=0)
    with pytest.raises(ConfigError):
        LinearCost(rate=1.0).observe(-1, 1.0)


def test_one_throttled_transfer_is_enough_to_switch():
    p = planner()
    transfers(p, "disk", 25.0, 50e-6)
    transfers(p, "disk", 0.05, 50e-6, n=1)  # a new regime: the fit restarts rather than averaging
    assert p.plan(blocks("disk"), question_tokens=128).fetch == {}


def test_a_skipped_tier_is_probed_so_its_recovery_is_seen():
    """Only fetches measure a tier: the planner fetches one block of a tier it kept skipping, so when the disk
    recovers the plan returns to fetching with no other source of measurements."""
    p = planner()
    p.probe_after = 8
    disk_gbs = 0.05
    transfers(p, "disk", disk_gbs, 50e-6, n=1)
    probes, plans = 0, []
    for step in range(40):
        if step == 20:
            disk_gbs = 25.0  # recovered; nobody tells the planner
        plan = p.plan(blocks("disk"), question_tokens=128)
        for _ in plan.fetch.get("disk", ()):  # what the store would report: only what it fetched
            p.observe_transfer("disk", BYTES, 50e-6 + BYTES / (disk_gbs * GB))
        probes += step < 20 and len(plan.fetch.get("disk", ())) == 1
        plans.append(plan)
    assert probes == 2  # throttled: one probe every 8 plans, the rest recomputed
    assert plans[-1].recompute == () and len(plans[-1].fetch["disk"]) == 10


def test_a_resident_tier_is_never_recomputed_however_slow_it_was_measured():
    """A CPU engine reads DRAM blocks in place (``fetcher.resident_tiers("cpu")``): measured slow (a stall), they
    are still used, at no transfer cost; a CUDA engine's DRAM blocks are planned as a transfer."""
    from inferscale.store.fetcher import resident_tiers

    for device, recomputed in (("cpu", 0), ("cuda", 10)):
        p = planner()
        p.resident = resident_tiers(device)
        transfers(p, "dram", gbs=0.001, fixed_s=0.5)  # far slower than recomputing 30 tokens at 30k tokens/s
        plan = p.plan(blocks("dram"))
        assert len(plan.recompute) == recomputed, device
        assert plan.fetch_s == 0 or device == "cuda"
