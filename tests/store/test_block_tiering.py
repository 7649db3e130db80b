"""Per-block tiering in the real store (issue 25): the DRAM and device tiers keep hot blocks through a scan of
one-touch blocks (frequency-filtered admission), warm-up only fills free room, shares and pins hold, and every
fetch is metered per tier."""

import torch

from inferscale.store.blockcache import BlockCache
from inferscale.store.devicetier import DeviceTier

from .helpers import FP, blob_bytes, make_block

BLOCK = blob_bytes()


def in_dram(s, tenant, user):
    return [i.item_id for i in s.list(tenant, user) if "dram" in i.tiers]


def test_a_one_touch_scan_does_not_push_out_hot_blocks(open_store):
    """Fails on the plain LRU the DRAM tier was before: the scan flushed h0 and h1."""
    s = open_store(dram_budget_bytes=4 * BLOCK, min_block_bytes=1)
    for i in ("h0", "h1", *(f"s{i}" for i in range(12))):
        s.put("acme", "alice", make_block(i), cache=False)
    for _ in range(3):
        s.get_many("acme", "alice", ["h0", "h1"], FP)
    for i in range(12):  # a scan: each block read once
        got, st = s.get_many("acme", "alice", [f"s{i}"], FP)
        assert st.served == {f"s{i}": "disk"} and torch.equal(got[0].kv, make_block(f"s{i}").kv)
        del got  # the request is done: its bypass slot is free again
    assert {"h0", "h1"} <= set(in_dram(s, "acme", "alice"))
    _, st = s.get_many("acme", "alice", ["h0", "h1"], FP)
    assert st.served == {"h0": "dram", "h1": "dram"}
    stats = s.stats()
    assert stats["dram_bypassed"] >= 10 and stats["dram_bytes"] <= 4 * BLOCK


def test_a_block_read_again_and_again_gets_in(open_store):
    s = open_store(dram_budget_bytes=2 * BLOCK, min_block_bytes=1)
    for i in ("a", "b", "c"):
        s.put("acme", "u", make_block(i), cache=False)
    for _ in range(2):
        s.get_many("acme", "u", ["a"], FP)
        s.get_many("acme", "u", ["b"], FP)
    s.get_many("acme", "u", ["c"], FP)
    assert "c" not in in_dram(s, "acme", "u")  # once: refused, served from a bypass slot
    for _ in range(3):
        s.get_many("acme", "u", ["c"], FP)
    assert "c" in in_dram(s, "acme", "u")


def test_warm_up_fills_free_room_but_never_evicts_hotter_blocks(open_store, tmp_path):
    s = open_store(dram_budget_bytes=3 * BLOCK, min_block_bytes=1)
    for i in range(3):
        s.put("acme", "hot", make_block(f"h{i}"), cache=False)
    for _ in range(2):
        s.get_many("acme", "hot", ["h0", "h1", "h2"], FP)
    for i in range(3):  # the operator's placement warming another user: offered, refused
        s.put("acme", "cold", make_block(f"c{i}"), cache=True)
    assert in_dram(s, "acme", "hot") == ["h0", "h1", "h2"] and in_dram(s, "acme", "cold") == []
    s.delete("acme", "hot")
    s.put("acme", "cold", make_block("c0"), cache=True)  # free room now: warm-up fills it
    assert in_dram(s, "acme", "cold") == ["c0"]


def test_another_tenants_scan_within_its_share_leaves_hot_blocks(open_store):
    s = open_store(dram_budget_bytes=4 * BLOCK, tenant_quota_bytes=4 * BLOCK, min_block_bytes=1)
    for i in range(2):
        s.put("b", "u", make_block(f"m{i}"), cache=False)
    for i in range(8):
        s.put("a", "u", make_block(f"m{i}"), cache=False)
    for _ in range(3):
        s.get_many("b", "u", ["m0", "m1"], FP)
    for i in range(8):
        s.get_many("a", "u", [f"m{i}"], FP)
    assert in_dram(s, "b", "u") == ["m0", "m1"]
    assert s.dram.tenant_bytes("a") <= 2 * BLOCK


def test_in_flight_and_store_pins_hold_against_hotter_blocks(open_store):
    s = open_store(dram_budget_bytes=3 * BLOCK, min_block_bytes=1)
    for i in ("p", "v", "w", "x", "y"):
        s.put("acme", "u", make_block(i), cache=False)
    s.pin("acme", "u", ["p"])
    held, _ = s.get_many("acme", "u", ["p", "v"], FP)  # v: in flight while the view lives
    s.get_many("acme", "u", ["w"], FP)
    for _ in range(4):  # x turns hotter than all three: it takes the place of w, the one neither pinned nor read
        s.get_many("acme", "u", ["x"], FP)
    assert in_dram(s, "acme", "u") == ["p", "v", "x"] and torch.equal(held[1].kv, make_block("v").kv)
    del held
    for _ in range(8):  # y hotter still: v is free to go now (LRU, unpinned); p stays pinned
        s.get_many("acme", "u", ["y"], FP)
    assert in_dram(s, "acme", "u") == ["p", "x", "y"] or in_dram(s, "acme", "u") == ["p", "v", "y"]
    assert "p" in in_dram(s, "acme", "u")


def test_fetches_are_metered_per_tier(open_store):
    s = open_store(dram_budget_bytes=4 * BLOCK, min_block_bytes=1)
    for i in range(2):
        s.put("acme", "u", make_block(f"m{i}"), cache=False)
    seen = []
    s.transfers["disk"].subscribe(lambda *a: seen.append(a))
    _, st = s.get_many("acme", "u", ["m0", "m1"], FP)
    assert st.tiers["disk"] == 2 and st.tier_bytes["disk"] == st.bytes_read > 0 and st.tier_seconds["disk"] > 0
    _, st2 = s.get_many("acme", "u", ["m0"], FP)
    assert st2.served == {"m0": "dram"} and st2.tier_bytes["dram"] == make_block("m0").nbytes
    disk, dram = s.transfers["disk"].totals(), s.transfers["dram"].totals()
    assert (disk.fetches, disk.blocks, disk.bytes) == (1, 2, st.bytes_read) and dram.blocks == 1
    assert seen and seen[0][:3] == ("disk", 2, st.bytes_read)


def test_device_tier_keeps_hot_blocks_through_a_scan():
    """The device tier on the CPU (the class is device-agnostic; a store enables it only with CUDA)."""
    n = make_block("h0").nbytes
    tier = DeviceTier(torch.device("cpu"), BlockCache(2 * n))
    for _ in range(3):
        for h in ("h0", "h1"):
            if tier.get(("t", "u", FP, h), n) is None:
                tier.put(("t", "u", FP, h), make_block(h), set())
    for i in range(10):
        key = ("t", "u", FP, f"s{i}")
        assert tier.get(key, n) is None
        dev, _ = tier.put(key, make_block(f"s{i}"), set())
        assert torch.equal(dev.kv, make_block(f"s{i}").kv)  # served either way
    assert tier.resident(("t", "u", FP, "h0")) and tier.resident(("t", "u", FP, "h1"))
    tier.set_pinned([("t", "u", FP, "h0")], True)
    assert tier.drop(lambda k: k[3] == "h0") == [("t", "u", FP, "h0")] and tier.stats()["gpu_blocks"] == 1
