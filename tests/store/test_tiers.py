"""DRAM/device tiers: LRU under a byte budget, pins, per-tenant quota, eviction keeps the disk copy."""

import random

import pytest
import torch

from inferscale.errors import QuotaExceededError
from inferscale.store.arena import Allocator

from .helpers import FP, blob_bytes, make_block

BLOCK = blob_bytes()


def tiers(s, tenant, user):
    return {i.item_id: i.tiers for i in s.list(tenant, user)}


def test_allocator_reuses_and_coalesces():
    a = Allocator(64 * 100)
    rng = random.Random(0)
    live = {}
    for _ in range(2000):
        if live and rng.random() < 0.5:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            n = rng.randint(1, 640)
            off = a.alloc(n)
            if off is not None:
                assert all(off + n <= o or o + s <= off for o, s in live.items())  # no overlap
                live[off] = n
    for off, n in list(live.items()):
        a.free(off, n)
    assert a.used == 0 and a.largest_free() == 64 * 100  # everything merged back into one extent


def test_lru_eviction_under_budget_keeps_disk_copy(open_store):
    s = open_store(dram_budget_bytes=3 * BLOCK, min_block_bytes=1)
    for i in range(5):
        s.put("acme", "alice", make_block(f"m{i}"), cache=False)
    s.get_many("acme", "alice", ["m0", "m1", "m2"], FP)
    s.get_many("acme", "alice", ["m0"], FP)  # m0 is now most recent; m1 is the LRU
    _, st = s.get_many("acme", "alice", ["m3"], FP)
    assert st.served == {"m3": "disk"}
    t = tiers(s, "acme", "alice")
    assert [i for i, tl in t.items() if "dram" in tl] == ["m0", "m2", "m3"]
    assert all("disk" in tl for tl in t.values())
    assert s.stats()["dram_bytes"] <= 3 * BLOCK
    got, st = s.get_many("acme", "alice", ["m1"], FP)  # evicted, not lost
    assert st.served == {"m1": "disk"} and torch.equal(got[0].kv, make_block("m1").kv)


def test_pins_are_never_evicted(open_store):
    s = open_store(dram_budget_bytes=3 * BLOCK, min_block_bytes=1)
    for i in range(6):
        s.put("acme", "alice", make_block(f"m{i}"), cache=False)
    assert s.pin("acme", "alice", ["m0", "m1"]) == 2
    s.get_many("acme", "alice", ["m0", "m1"], FP)
    for i in range(2, 6):
        s.get_many("acme", "alice", [f"m{i}"], FP)
        t = tiers(s, "acme", "alice")
        assert "dram" in t["m0"] and "dram" in t["m1"]
    s.pin("acme", "alice", ["m5"])
    with pytest.raises(QuotaExceededError, match="pinned"):
        s.get_many("acme", "alice", ["m2"], FP)
    s.unpin("acme", "alice")
    _, st = s.get_many("acme", "alice", ["m2", "m3"], FP)
    assert st.tiers["disk"] == 2


def test_request_larger_than_budget_is_typed(open_store):
    s = open_store(dram_budget_bytes=2 * BLOCK, min_block_bytes=1)
    for i in range(3):
        s.put("acme", "alice", make_block(f"m{i}"), cache=False)
    with pytest.raises(QuotaExceededError, match="DRAM budget"):
        s.get_many("acme", "alice", ["m0", "m1", "m2"], FP)


def test_per_tenant_quota(open_store):
    s = open_store(dram_budget_bytes=6 * BLOCK, tenant_quota_bytes=2 * BLOCK, min_block_bytes=1)
    for i in range(4):
        s.put("a", "u", make_block(f"m{i}"), cache=False)
        s.put("b", "u", make_block(f"m{i}"), cache=False)
    s.get_many("b", "u", ["m0", "m1"], FP)
    for i in range(4):  # tenant a cycles through more than its quota
        s.get_many("a", "u", [f"m{i}"], FP)
        assert s.dram.tenant_bytes("a") <= 2 * BLOCK
    # a's pressure evicted only a's own blocks: b keeps both although the arena had room pressure
    assert [i for i, t in tiers(s, "b", "u").items() if "dram" in t] == ["m0", "m1"]
    assert [i for i, t in tiers(s, "a", "u").items() if "dram" in t] == ["m2", "m3"]
    with pytest.raises(QuotaExceededError, match="quota"):
        s.get_many("a", "u", ["m0", "m1", "m2"], FP)
    s.pin("a", "u", ["m2", "m3"])
    with pytest.raises(QuotaExceededError, match="quota"):
        s.get_many("a", "u", ["m0"], FP)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_tier_lru_and_promotion(open_store):  # pragma: no cover - runs on GPU machines
    kv_bytes = make_block("m0").nbytes
    s = open_store(gpu_budget_bytes=2 * kv_bytes, min_block_bytes=1)
    for i in range(3):
        s.put("acme", "alice", make_block(f"m{i}"))
    got, st = s.get_many("acme", "alice", ["m0", "m1"], FP)
    assert st.tiers["dram"] == 2 and got[0].kv.is_cuda
    _, st = s.get_many("acme", "alice", ["m0"], FP)
    assert st.served == {"m0": "gpu"}
    got, st = s.get_many("acme", "alice", ["m2"], FP)  # evicts m1 from the device
    assert torch.equal(got[0].kv.cpu(), make_block("m2").kv)
    assert "gpu" not in tiers(s, "acme", "alice")["m1"]


def test_gpu_budget_without_cuda_is_skipped_cleanly(open_store):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    s = open_store(gpu_budget_bytes=64 << 20)
    s.put("acme", "alice", make_block("m0"))
    got, st = s.get_many("acme", "alice", ["m0"], FP)
    assert st.tiers["gpu"] == 0 and got[0].kv.device.type == "cpu" and s.stats()["gpu_budget"] == 0
