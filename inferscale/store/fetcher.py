"""Fetch or recompute, in the request path: for a request's retrieved blocks, ask the planner (fetchplan.py) which
to bring from their tier and which to recompute from their text, fetch the first, read the memory records of the
second, and teach the planner what the fetch cost.

What it learns from: each tier's cost from the store's own transfers (``FetchStats.tier_bytes`` and
``tier_seconds`` of every fetch, one observation per tier and request, per block on average); prefill from the
serving loop's measured seconds per prompt token (``EngineBackend.prompt_token_s``, the loop's ``StepCost``), read
at each plan: one measurement, not a second one. Before the engine measured a prompt token nothing is recomputed
(never on a guess); blocks this pod does not hold (the fleet path leases them from a peer) and memories whose
record does not open are always fetched.

Fetch and compute run one after the other here: the store's fetch ends before the engine admits the request, so
the plan is made without overlap (``FetchPlanner(overlap=False)``: each block takes the cheaper of its two costs).
Recomputed memories are prefilled behind the fetched blocks and before the question (``GenRequest.recompute_ids``):
with every block recomputed the prompt is exactly text mode's; with some fetched, the recomputed ones move behind
them (the order within each part is kept)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from inferscale.kvformat import KVBlock
from inferscale.store.fetchplan import DEVICE_TIER, FetchPlan, FetchPlanner, LinearCost, PlanBlock
from inferscale.store.fleet import Fetched, Fleet
from inferscale.store.memrecord import MemoryRecord
from inferscale.store.results import FetchStats

PLANNED_TIERS = ("dram", "disk")  # tiers whose fetches teach the planner; "gpu" blocks are always used


def resident_tiers(engine_device: str) -> frozenset[str]:
    """The tiers an engine on ``engine_device`` ("cuda", "cpu") injects blocks from in place, never recomputed around:
    the device tier, and on a CPU engine DRAM, whose blocks it reads as zero-copy views. A DRAM "fetch" there moves
    no bytes: its measured seconds are lookups and waits for the interpreter's lock, which a recompute would not
    save. Planned, they flipped answers with load: one slow DRAM fetch amid another tenant's flood made the next kv
    request recompute its two memories and answer otherwise (a CI run of tests/server/test_answers_under_load.py;
    reproduced by a 0.3 s stall in the DRAM fetch's meter: the same changed answer, 2026-12-07)."""
    return frozenset({DEVICE_TIER, "dram"} if engine_device == "cpu" else {DEVICE_TIER})


def default_planner(resident: frozenset[str] = frozenset({DEVICE_TIER})) -> FetchPlanner:
    """Priors until the first transfers are measured: DRAM fast, disk fast enough to be fetched (and so measured)."""
    return FetchPlanner(tiers={"dram": LinearCost(rate=10e9, fixed_s=1e-5), "disk": LinearCost(rate=1e9, fixed_s=1e-4)},
                        prefill=LinearCost(rate=1.0), overlap=False, resident=resident)


@dataclass
class Planned:
    """One request's memories: the blocks fetched and the memories to recompute, both in injection order."""

    blocks: list[KVBlock]
    recompute: list[MemoryRecord]
    plan: FetchPlan | None  # None: nothing was planned (no prefill measured yet, planning off, nothing local)
    stats: FetchStats = field(default_factory=FetchStats)  # of the fetch (empty when nothing was fetched)
    fetch_s: float = 0.0  # measured wall time of the fetch, peer pulls included
    fetched: Fetched | None = None

    @property
    def recompute_ids(self) -> list[int]:
        return [t for r in self.recompute for t in r.token_ids]

    def attributes(self, prefix: str = "inferscale.kv.plan.") -> dict[str, int | float]:
        """The plan on the ``kv_fetch`` span: blocks per tier, recomputed tokens, predicted and measured times."""
        if self.plan is None:
            return {}
        out = self.plan.as_attributes(prefix)
        out[f"{prefix}fetch_actual_s"] = self.fetch_s
        return out


class Fetcher:
    """One per pod, beside its ``Fleet``; thread-safe (the planner's state is behind a lock)."""

    def __init__(self, fleet: Fleet, planner: FetchPlanner | None = None) -> None:
        self.fleet = fleet
        self.planner = planner if planner is not None else default_planner()
        self.planning = True  # off: every block is fetched (the planner still learns from the fetches)
        self._lock = threading.Lock()

    def fetch(self, tenant: str, user: str, item_ids: list[str], fingerprint: str,
              prompt_token_s: float | None) -> Planned:
        """The memories of ``item_ids`` (injection order), each fetched or to be recomputed as planned."""
        plan = self._plan(tenant, user, item_ids, fingerprint, prompt_token_s)
        chosen = [] if plan is None else list(plan.recompute)
        records = self.fleet.store.memory_records(tenant, user, chosen, fingerprint) if chosen else {}
        recompute = [records[i] for i in item_ids if i in records]
        fetch_ids = [i for i in item_ids if i not in records]
        if not fetch_ids:
            return Planned([], recompute, plan)
        t0 = time.perf_counter()
        got = self.fleet.blocks(tenant, user, fetch_ids, fingerprint)
        seconds = time.perf_counter() - t0
        self._learn(got.stats)
        return Planned(got.blocks, recompute, plan, got.stats, seconds, got)

    def _plan(self, tenant: str, user: str, item_ids: list[str], fingerprint: str,
              prompt_token_s: float | None) -> FetchPlan | None:
        if not self.planning or not prompt_token_s:
            return None
        where = self.fleet.store.locate(tenant, user, item_ids, fingerprint)
        blocks = [PlanBlock(i, where[i].tiers[0], where[i].size, where[i].tokens)
                  for i in dict.fromkeys(item_ids) if i in where]
        if not blocks:
            return None
        with self._lock:
            self.planner.use_prefill_rate(prompt_token_s)
            return self.planner.plan(blocks)

    def _learn(self, stats: FetchStats) -> None:
        """One observation per tier that served blocks: a block's average bytes and seconds."""
        with self._lock:
            for tier in PLANNED_TIERS:
                n, seconds = stats.tiers.get(tier, 0), stats.tier_seconds.get(tier, 0.0)
                if n and seconds > 0:
                    self.planner.observe_transfer(tier, stats.tier_bytes.get(tier, 0) // n, seconds / n)
