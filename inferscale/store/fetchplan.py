"""Fetch or recompute: for a request's retrieved blocks, which to bring from their tier and which to recompute.

Costs are learned online, never configured as truths: each tier's transfers teach it ``seconds = fixed + bytes /
bandwidth`` and the engine's prefills teach it ``seconds = fixed + tokens / throughput`` (``LinearCost``: least
squares over exponentially decayed observations, restarted when one is far off the prediction, so a tier that
slows down is seen as slow from its first slow transfer, and as fast again from its first fast one).

The time model (``FetchPlanner.plan``):
- fetch  F = Σ over fetched blocks of their tier's cost of that block (transfers of one request run one after
  another); a block already on the device (``gpu``) costs nothing and is always used;
- compute C = prefill cost of (question tokens + recomputed blocks' tokens), in the same pass as the question;
- overlap: predicted = max(F, C), as when transfers run layer by layer behind compute; without overlap
  (``overlap=False``) predicted = F + C.
With overlap the planner orders blocks by fetch cost ÷ recompute cost and picks the split (fetch the cheapest
j, recompute the rest) of least predicted time, preferring fetches on ties (recompute spends the GPU others
share); this is the exact optimum when a request's blocks are alike and greedy-by-ratio otherwise. Without
overlap each block takes the cheaper of its two costs. No torch, no clock: callers pass sizes and seconds.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from inferscale.errors import ConfigError

DEVICE_TIER = "gpu"  # blocks already on the device: injected at no transfer cost
DEFAULT_HALF_LIFE = 16.0  # observations after which an old one weighs half
# An observation this many times off the prediction (either way) is a new regime (a throttled or recovered link):
# the fit restarts from it instead of averaging two regimes, where the slow one would dominate for many transfers.
REGIME_FACTOR = 4.0


@dataclass
class LinearCost:
    """Online estimate of ``seconds = fixed_s + units / rate`` (units: bytes for a tier, tokens for prefill).

    Starts at the prior (``rate``, ``fixed_s``) and follows weighted least squares over the observations, each
    older one weighing ``0.5 ** (1 / half_life)`` of the next; one ``REGIME_FACTOR`` off the prediction restarts
    the fit. While every observation had the same size the
    fixed cost cannot be told from the rate: the prior fixed cost is kept and only the rate is fit."""

    rate: float
    fixed_s: float = 0.0
    half_life: float = DEFAULT_HALF_LIFE
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5, repr=False)  # w, Σx, Σy, Σxx, Σxy

    def __post_init__(self) -> None:
        if not self.rate > 0 or self.fixed_s < 0 or not self.half_life > 0:
            raise ConfigError(f"cost model: rate {self.rate} must be > 0, fixed {self.fixed_s} s >= 0, "
                              f"half-life {self.half_life} > 0")
        self._prior_fixed = self.fixed_s

    def predict(self, units: float) -> float:
        return self.fixed_s + units / self.rate

    def observe(self, units: float, seconds: float) -> None:
        """One measured transfer (or prefill) of ``units`` that took ``seconds``."""
        if units < 0 or seconds < 0:
            raise ConfigError(f"observation: {units} units in {seconds} s must not be negative")
        predicted = self.predict(units)
        surprise = seconds > REGIME_FACTOR * predicted or seconds * REGIME_FACTOR < predicted
        decay = 0.0 if surprise else 0.5 ** (1.0 / self.half_life)
        w, sx, sy, sxx, sxy = (s * decay for s in self._sums)
        self._sums = [w + 1, sx + units, sy + seconds, sxx + units * units, sxy + units * seconds]
        self._refit()

    def _refit(self) -> None:
        w, sx, sy, sxx, sxy = self._sums
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var > 1e-9 * mx * mx and w > 1.5:
            slope = (sxy / w - mx * my) / var  # seconds per unit
            fixed = my - slope * mx
            if slope > 0 and fixed >= 0:
                self.rate, self.fixed_s = 1.0 / slope, fixed
                return
        # One size seen (or a fit outside the physical range): keep the prior fixed cost, fit the rate.
        moving = sy - w * self._prior_fixed
        if sx > 0 and moving > 0:
            self.rate, self.fixed_s = sx / moving, self._prior_fixed
        elif sx > 0 and sy > 0:  # faster than the prior fixed cost alone: there is no such fixed cost
            self.rate, self.fixed_s = sx / sy, 0.0


@dataclass(frozen=True)
class PlanBlock:
    """A retrieved block as the planner sees it: where it is now, its size and its token count."""

    key: Hashable
    tier: str
    bytes: int
    tokens: int


@dataclass(frozen=True)
class FetchPlan:
    """The decision for one request: blocks to fetch per tier, blocks to recompute, and the predicted times."""

    fetch: Mapping[str, tuple[Hashable, ...]]
    recompute: tuple[Hashable, ...]
    recomputed_tokens: int
    fetch_bytes: int
    fetch_s: float
    compute_s: float
    predicted_s: float
    overlap: bool

    def as_attributes(self, prefix: str = "kv.plan.") -> dict[str, int | float]:
        """Flat attributes for the ``kv_fetch`` span (the actual time is the span's own)."""
        out: dict[str, int | float] = {f"{prefix}tier.{t}": len(keys) for t, keys in self.fetch.items()}
        out.update({f"{prefix}recomputed_blocks": len(self.recompute),
                    f"{prefix}recomputed_tokens": self.recomputed_tokens, f"{prefix}fetch_bytes": self.fetch_bytes,
                    f"{prefix}fetch_s": self.fetch_s, f"{prefix}compute_s": self.compute_s,
                    f"{prefix}predicted_s": self.predicted_s})
        return out


@dataclass
class FetchPlanner:
    """Per-tier transfer costs and the engine's prefill cost, learned online; ``plan`` decides per request."""

    tiers: dict[str, LinearCost]
    prefill: LinearCost
    overlap: bool = True
    # A tier skipped by this many plans in a row has one block fetched anyway: only fetches measure a tier, so
    # without a probe a tier once slow would be recomputed around forever, even after it recovers. 0: never.
    probe_after: int = 32
    # Tiers the engine reads its blocks from in place: used at no transfer cost, never recomputed around
    # (``fetcher.resident_tiers``: the device tier; on a CPU engine DRAM too).
    resident: frozenset[str] = frozenset({DEVICE_TIER})
    _skipped: dict[str, int] = field(default_factory=dict, repr=False)

    def observe_transfer(self, tier: str, nbytes: int, seconds: float) -> None:
        self._tier(tier).observe(nbytes, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.observe(tokens, seconds)

    def use_prefill_rate(self, seconds_per_token: float) -> None:
        """Take the prefill cost from a measurement kept elsewhere (the serving loop's ``StepCost``, one estimate
        of one quantity): marginal seconds per token, no fixed cost (the pass runs for the question anyway)."""
        self.prefill = LinearCost(rate=1.0 / seconds_per_token)

    def fetch_cost(self, block: PlanBlock) -> float:
        return 0.0 if block.tier in self.resident else self._tier(block.tier).predict(block.bytes)

    def compute_cost(self, tokens: int) -> float:
        return self.prefill.predict(tokens) if tokens > 0 else 0.0

    def plan(self, blocks: list[PlanBlock], question_tokens: int = 0) -> FetchPlan:
        resident = [b for b in blocks if b.tier in self.resident]
        movable = [b for b in blocks if b.tier not in self.resident]
        if self.overlap:
            fetched, recomputed = self._split_overlapped(movable, question_tokens)
        else:
            fetched, recomputed = self._split_serial(movable)
        self._probe(fetched, recomputed)
        return self._build(resident, fetched, recomputed, question_tokens)

    def _probe(self, fetched: list[PlanBlock], recomputed: list[PlanBlock]) -> None:
        """Count the plans that skip each tier; at ``probe_after``, move its cheapest block to ``fetched``."""
        used = {b.tier for b in fetched}
        for tier in {b.tier for b in recomputed} - used:
            self._skipped[tier] = self._skipped.get(tier, 0) + 1
            if self.probe_after and self._skipped[tier] >= self.probe_after:
                probe = min((b for b in recomputed if b.tier == tier), key=self.fetch_cost)
                recomputed.remove(probe)
                fetched.append(probe)
                used.add(tier)
        for tier in used:
            self._skipped[tier] = 0

    def _split_serial(self, movable: list[PlanBlock]) -> tuple[list[PlanBlock], list[PlanBlock]]:
        per_token = 1.0 / self.prefill.rate  # marginal: the pass runs for the question anyway
        fetched = [b for b in movable if self.fetch_cost(b) <= b.tokens * per_token]
        return fetched, [b for b in movable if b not in fetched]

    def _split_overlapped(self, movable: list[PlanBlock], question: int) -> tuple[list[PlanBlock], list[PlanBlock]]:
        per_token = 1.0 / self.prefill.rate
        order = sorted(movable, key=lambda b: self.fetch_cost(b) / max(b.tokens * per_token, 1e-12))
        tokens_left = sum(b.tokens for b in order)
        best_j, best_t, fetch = 0, max(0.0, self.compute_cost(question + tokens_left)), 0.0
        for j, b in enumerate(order, start=1):
            fetch += self.fetch_cost(b)
            tokens_left -= b.tokens
            t = max(fetch, self.compute_cost(question + tokens_left))
            if t <= best_t:
                best_j, best_t = j, t
        return order[:best_j], order[best_j:]

    def _build(self, resident: list[PlanBlock], fetched: list[PlanBlock], recomputed: list[PlanBlock],
               question: int) -> FetchPlan:
        per_tier: dict[str, list[Hashable]] = {}
        for b in resident + fetched:
            per_tier.setdefault(b.tier, []).append(b.key)
        fetch_s = sum(self.fetch_cost(b) for b in fetched)
        tokens = sum(b.tokens for b in recomputed)
        compute_s = self.compute_cost(question + tokens)
        total = max(fetch_s, compute_s) if self.overlap else fetch_s + compute_s
        return FetchPlan(fetch={t: tuple(k) for t, k in per_tier.items()}, recompute=tuple(b.key for b in recomputed),
                         recomputed_tokens=tokens, fetch_bytes=sum(b.bytes for b in fetched), fetch_s=fetch_s,
                         compute_s=compute_s, predicted_s=total, overlap=self.overlap)

    def _tier(self, tier: str) -> LinearCost:
        try:
            return self.tiers[tier]
        except KeyError:
            raise ConfigError(f"tier {tier!r} has no cost model; known: {', '.join(sorted(self.tiers))}") from None
