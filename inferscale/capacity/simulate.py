"""One serving node replaying a trace with the store's own policy code and simulated time.

The caches are ``store.blockcache.BlockCache`` (one for HBM, one for DRAM; disk holds every blob) and the
per-block path's decisions come from ``store.fetchplan.FetchPlanner``, learning each tier's cost from the
transfers the simulated links report. A link is ``LinearCost`` too (fixed cost per block + bytes / bandwidth),
here as the truth that produces the seconds; prefill likewise. So the plan predicts what that code does.

Two ways to cache, on the same trace and node:
- ``per-block``: keys are (user, memory); a request brings up its k blocks only, from wherever each is (or
  recomputes them, as the planner decides); frequency-filtered admission (TinyLFU).
- ``per-block-lru``: the same without the frequency filter;
- ``whole-user``: keys are users (what the store's DRAM LRU and the operator's placement do today): a miss on
  HBM moves the whole user up from DRAM or disk; plain LRU.
Not modelled: queueing on a link between requests (each request's transfers are timed as if alone), and the
peer plane (a node reads only its own disk).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from inferscale.capacity.workload import Trace
from inferscale.store.blockcache import BlockCache
from inferscale.store.fetchplan import DEVICE_TIER, FetchPlanner, LinearCost, PlanBlock

TENANT = "fleet"  # one tenant: the plan sizes a fleet, not the split between tenants
TIERS = (DEVICE_TIER, "dram", "disk", "recomputed")


@dataclass(frozen=True)
class NodeShape:
    """A serving node: KV bytes of HBM (all GPUs), DRAM and disk; the DRAM→HBM and disk→HBM links (bandwidth,
    fixed cost per block); prefill throughput in tokens/s."""

    hbm_bytes: int
    dram_bytes: int
    disk_bytes: int
    dram_gbs: float
    disk_gbs: float
    dram_fixed_s: float
    disk_fixed_s: float
    prefill_tokens_s: float

    def links(self) -> dict[str, LinearCost]:
        return {"dram": LinearCost(rate=self.dram_gbs * 1e9, fixed_s=self.dram_fixed_s),
                "disk": LinearCost(rate=self.disk_gbs * 1e9, fixed_s=self.disk_fixed_s)}

    def prefill(self) -> LinearCost:
        return LinearCost(rate=self.prefill_tokens_s)


@dataclass
class ModeResult:
    """What one caching mode did over the measured requests (after warm-up)."""

    mode: str
    fetch_s: list[float] = field(default_factory=list)  # transfer time of each request
    ready_s: list[float] = field(default_factory=list)  # KV ready and question prefilled (the plan's time)
    moved_bytes: list[int] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # blocks per tier
    recomputed_tokens: int = 0
    memory_tokens: int = 0
    caches: dict[str, BlockCache] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        blocks = sum(self.served.values()) or 1
        f, r = np.asarray(self.fetch_s), np.asarray(self.ready_s)
        out = {f"share_{t}": self.served[t] / blocks for t in TIERS}
        out.update({
            "requests": len(self.fetch_s), "bytes_per_request": float(np.mean(self.moved_bytes)),
            "fetch_p50_s": float(np.percentile(f, 50)), "fetch_p99_s": float(np.percentile(f, 99)),
            "fetch_mean_s": float(f.mean()), "ready_p50_s": float(np.percentile(r, 50)),
            "ready_p99_s": float(np.percentile(r, 99)),
            "recompute_share": self.recomputed_tokens / max(self.memory_tokens, 1),
            "hbm_hit_rate": self.caches["hbm"].stats.hit_rate, "dram_hit_rate": self.caches["dram"].stats.hit_rate,
        })
        return out


def _caches(node: NodeShape, scale: float, frequency_filter: bool) -> dict[str, BlockCache]:
    return {"hbm": BlockCache(int(node.hbm_bytes * scale), frequency_filter=frequency_filter),
            "dram": BlockCache(int(node.dram_bytes * scale), frequency_filter=frequency_filter)}


def _tier_of(caches: dict[str, BlockCache], key: object, size: int) -> str:
    if caches["hbm"].lookup(key, size):
        return DEVICE_TIER
    return "dram" if caches["dram"].lookup(key, size) else "disk"


BlockSizes = Mapping[tuple[int, int], int]  # (user, memory) -> bytes, where blocks differ (a measured corpus)


def per_block(trace: Trace, node: NodeShape, *, block_bytes: int, block_tokens: int, scale: float,
              question_tokens: int, warmup: int, overlap: bool = True, frequency_filter: bool = True,
              sizes: BlockSizes | None = None) -> ModeResult:
    """The trace with block caching and the fetch-or-recompute planner (priors: the node's nominal links);
    ``frequency_filter=False`` is the same with plain LRU (mode ``per-block-lru``), to show what the filter buys.
    ``sizes``: each block's own bytes (else every block is ``block_bytes``)."""
    size = (lambda key: block_bytes) if sizes is None else sizes.__getitem__
    mode = "per-block" if frequency_filter else "per-block-lru"
    res = ModeResult(mode, caches=_caches(node, scale, frequency_filter=frequency_filter))
    hbm, dram = res.caches["hbm"], res.caches["dram"]
    truth, true_prefill = node.links(), node.prefill()
    planner = FetchPlanner(tiers=node.links(), prefill=node.prefill(), overlap=overlap)
    for n, req in enumerate(trace.requests):
        keys = [(req.user, b) for b in req.blocks]
        for key in keys:
            hbm.pin(key)
            dram.pin(key)
        blocks = [PlanBlock(key, _tier_of(res.caches, key, size(key)), size(key), block_tokens) for key in keys]
        plan = planner.plan(blocks, question_tokens)
        fetch = 0.0
        for tier, fetched in plan.fetch.items():
            for key in fetched if tier != DEVICE_TIER else ():
                seconds = truth[tier].predict(size(key))
                planner.observe_transfer(tier, size(key), seconds)
                fetch += seconds
        compute = true_prefill.predict(question_tokens + plan.recomputed_tokens)
        planner.observe_prefill(question_tokens + plan.recomputed_tokens, compute)
        for key in plan.fetch.get("disk", ()):
            dram.admit(key, TENANT, size(key))
        for key in (*plan.fetch.get("disk", ()), *plan.fetch.get("dram", ()), *plan.recompute):
            hbm.admit(key, TENANT, size(key))  # fetched or recomputed, the block is on the device now
        for key in keys:
            hbm.unpin(key)
            dram.unpin(key)
        if n >= warmup:
            _record(res, fetch, max(fetch, compute) if overlap else fetch + compute, plan.fetch_bytes,
                    [b.tier for b in blocks if b.key not in plan.recompute], len(plan.recompute))
            res.recomputed_tokens += plan.recomputed_tokens
            res.memory_tokens += len(keys) * block_tokens
    return res


def whole_user(trace: Trace, node: NodeShape, *, block_bytes: int, block_tokens: int, scale: float,
               question_tokens: int, warmup: int, sizes: BlockSizes | None = None) -> ModeResult:
    """The trace with whole users cached (plain LRU): a user missing from HBM comes up whole."""
    user_bytes: dict[int, int] = {}
    if sizes is not None:
        for (user, _), n in sizes.items():
            user_bytes[user] = user_bytes.get(user, 0) + n
    res = ModeResult("whole-user", caches=_caches(node, scale, frequency_filter=False))
    truth, true_prefill = node.links(), node.prefill()
    compute = true_prefill.predict(question_tokens) if question_tokens else 0.0
    for n, req in enumerate(trace.requests):
        count = int(trace.memories[req.user])
        size = user_bytes.get(req.user, count * block_bytes)
        tier = _tier_of(res.caches, req.user, size)
        fetch = 0.0 if tier == DEVICE_TIER else count * truth[tier].predict(size / count)
        if tier == "disk":
            res.caches["dram"].admit(req.user, TENANT, size)
        res.caches["hbm"].admit(req.user, TENANT, size)
        if n >= warmup:
            _record(res, fetch, max(fetch, compute), 0 if tier == DEVICE_TIER else size, [tier] * len(req.blocks), 0)
            res.memory_tokens += len(req.blocks) * block_tokens
    return res


def _record(res: ModeResult, fetch: float, ready: float, moved: int, tiers: list[str], recomputed: int) -> None:
    res.fetch_s.append(fetch)
    res.ready_s.append(ready)
    res.moved_bytes.append(moved)
    for t in tiers:
        res.served[t] += 1
    res.served["recomputed"] += recomputed
