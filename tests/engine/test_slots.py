"""The slot pool on a CPU: mapped whole, backed a page at a time as it is written (issue 22: a growth stalled every
stream for ~300 ms)."""

from __future__ import annotations

import pytest
import torch

from inferscale.engine.slots import SlotCache, lazy_zeros
from inferscale.models.layout import LayerSpec, ModelLayout

# Gemma-3-270M's K/V shape: 18 layers of one 256-dim head, 32,768 positions
GEMMA_270M = ModelLayout(layers=tuple(LayerSpec(i, "full_attention", None, torch.ones(128)) for i in range(18)),
                         num_kv_heads=1, head_dim=256, max_positions=32768)


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


@pytest.mark.skipif(lazy_zeros((1,), torch.bfloat16) is None, reason="no lazily backed mapping on this system")
def test_a_pool_mapping_every_slot_at_the_whole_context_holds_only_what_is_written():
    """64 slots x 32,768 tokens of Gemma-3-270M's K/V address 38.7 GB, more than this machine's memory; only the
    reservation (2 x 64 tokens) and the pages written are resident. A sequence written at the last slot, near the end
    of the context, reads back; everything unwritten reads zero; a swap keeps both sequences."""
    before = resident_mb()
    pool = SlotCache(GEMMA_270M, torch.bfloat16, torch.device("cpu"), slots=2, capacity=64, most=(64, 32768))
    assert pool.lazy and pool.nbytes > 38e9
    assert (pool.slots, pool.capacity, pool.reserved) == (64, 32768, (2, 64))
    kv = torch.randn(18, 2, 1, 300, 256)
    pool.write(63, kv)
    tail = torch.randn(18, 2, 1, 100, 256)
    pool.write_groups(63, [(list(range(18)), tail, 32600, 32700)])
    assert resident_mb() - before < 200  # ~11 MB of K/V written, a few MB of tables
    assert torch.equal(pool.keys[17][63, :, :300], kv[17, 0].to(torch.bfloat16))
    assert torch.equal(pool.values[4][63, :, 32600:32700], tail[4, 1].to(torch.bfloat16))
    assert not pool.keys[0][63, :, 300:32600].any() and not pool.values[9][:63].any()
    pool.swap(0, 63, 0, 32700)
    assert torch.equal(pool.values[4][0, :, 32600:32700], tail[4, 1].to(torch.bfloat16))
    assert pool.grown_s == 0.0


@pytest.mark.skipif(lazy_zeros((1,), torch.bfloat16) is None, reason="no lazily backed mapping on this system")
def test_a_mapped_pool_refuses_to_grow_past_what_it_maps():
    """The loop runs no more rows than it mapped and no sequence past the context: asking more is a bug, refused
    with what was asked, never a copy that would back every page of the mapping."""
    pool = SlotCache(GEMMA_270M, torch.bfloat16, torch.device("cpu"), slots=1, capacity=16, most=(4, 1024))
    pool.reserve(4, 1024)
    with pytest.raises(ValueError, match="5 slots x 1024 tokens"):
        pool.reserve(5, 1024)
    with pytest.raises(ValueError, match="1 slots x 1025 tokens"):
        pool.reserve(1, 1025)


def test_a_pool_where_no_mapping_is_had_grows_as_before(monkeypatch):
    """Strict overcommit refuses the mapping (or the pool is on a GPU): the tensors are allocated at the reservation
    and grow by reallocation, keeping what they hold."""
    monkeypatch.setattr("inferscale.engine.slots.lazy_zeros", lambda shape, dtype: None)
    pool = SlotCache(GEMMA_270M, torch.bfloat16, torch.device("cpu"), slots=1, capacity=16, most=(4, 1024))
    assert not pool.lazy and (pool.slots, pool.capacity) == (1, 16)
    kv = torch.randn(18, 2, 1, 16, 256)
    pool.write(0, kv)
    pool.reserve(2, 20)
    assert (pool.slots, pool.capacity) == (2, 256) and pool.grown_s > 0
    assert torch.equal(pool.keys[3][0], torch.cat([kv[3, 0], torch.zeros(1, 240, 256)], 1).to(torch.bfloat16))


@pytest.mark.skipif(lazy_zeros((1,), torch.bfloat16) is None, reason="no lazily backed mapping on this system")
def test_a_mapped_pool_gives_back_what_its_slots_hold_past_the_reservation_beyond_the_room_it_is_given():
    """``trim``: while what the slots wrote past the reservation fits the room the K/V budget leaves, a finished
    sequence's pages stay for the next one (written again they cost ~11x); past it every slot gives back its pages
    past the reservation and past the sequence it holds (a swap's stale tail included). The reservation's pages,
    and the running sequences' tokens (a page partly kept included), stay as they are."""
    pool = SlotCache(GEMMA_270M, torch.bfloat16, torch.device("cpu"), slots=2, capacity=64, most=(8, 32768))
    long = torch.ones(18, 2, 1, 8000, 256, dtype=torch.bfloat16)  # 147 MB of K/V
    short = torch.full((18, 2, 1, 10, 256), 2.0, dtype=torch.bfloat16)
    before = resident_mb()
    pool.write(5, long)
    assert resident_mb() - before > 140 and pool.backed == 8000
    pool.trim([0] * 5 + [10], room=7990)  # the 7,990 tokens past the sequence's 10 fit the room: kept
    assert resident_mb() - before > 140 and pool.backed == 8000
    pool.trim([0] * 5 + [10], room=7989)
    assert resident_mb() - before < 5 and pool.backed == 10
    assert torch.equal(pool.keys[7][5, :, :10], long[7, 0, :, :10]) and not pool.keys[7][5, :, 16:].any()
    pool.write(0, long)
    pool.write(1, short)
    pool.swap(0, 1, 8000, 10)  # slot 0 now holds the short one, and the long one's tail
    assert pool.backed == 2 * (8000 - 64) + 10  # and slot 5's 10 tokens
    pool.trim([10, 8000], room=0)
    assert resident_mb() - before < 200 and pool.backed == 8000 - 64  # one copy, not two (294 MB)
    assert torch.equal(pool.values[2][1, :, :8000], long[2, 1]) and torch.equal(pool.values[2][0, :, :10], short[2, 1])
    pool.trim([], room=0)  # every sequence ended: past the reservation the pool holds nothing
    assert resident_mb() - before < 40 and pool.backed == 0  # (the swap's copies may stay in the heap)
    assert torch.equal(pool.values[2][1, :, :64], long[2, 1, :, :64]) and not pool.values[2][1, :, 64:].any()
