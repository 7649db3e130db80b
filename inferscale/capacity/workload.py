"""Who asks, how often, for which memories: a synthetic population (lognormal memories per user, Zipf traffic over
the day's active users, Zipf retrieval over a user's memories) or a trace file of requests."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inferscale.errors import ConfigError


@dataclass(frozen=True)
class Population:
    """Users and their memories. ``mean_memories`` is the distribution's mean (exp(μ + σ²/2) for a lognormal),
    or the trace's own mean: what the corpus, and so storage, is sized on."""

    users: int
    mu: float
    sigma: float
    tokens_per_memory: int
    daily_active: float

    def __post_init__(self) -> None:
        if self.users < 1 or self.sigma < 0 or self.tokens_per_memory < 1 or not 0 < self.daily_active <= 1:
            raise ConfigError("population: users and tokens per memory must be >= 1, sigma >= 0, daily active "
                              "share in (0, 1]")

    @property
    def mean_memories(self) -> float:
        return math.exp(self.mu + self.sigma ** 2 / 2)

    def draw_memories(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Memories of ``n`` users (at least one each)."""
        return np.maximum(1, np.rint(rng.lognormal(self.mu, self.sigma, n))).astype(np.int64)


@dataclass(frozen=True)
class Request:
    user: int
    blocks: tuple[int, ...]  # indices into the user's memories, distinct


@dataclass(frozen=True)
class Trace:
    """Requests in time order for users 0..n-1, each user's memory count, and the span of time they cover."""

    memories: np.ndarray
    requests: list[Request]
    seconds: float


def _zipf(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


class _Retrieval:
    """Top-k as seen by the cache: k distinct memories of a user, the most retrieved ones more often (Zipf)."""

    def __init__(self, rng: np.random.Generator, exponent: float) -> None:
        self.rng, self.exponent = rng, exponent
        self._cdfs: dict[int, np.ndarray] = {}

    def pick(self, memories: int, k: int) -> tuple[int, ...]:
        if k >= memories:
            return tuple(range(memories))
        cdf = self._cdfs.get(memories)
        if cdf is None:
            cdf = self._cdfs[memories] = np.cumsum(_zipf(memories, self.exponent))
        chosen: dict[int, None] = {}
        while len(chosen) < k:  # draws with replacement, duplicates dropped: distinct, Zipf-ordered
            for i in np.searchsorted(cdf, self.rng.random(2 * k), side="right"):
                chosen.setdefault(int(min(i, memories - 1)), None)
                if len(chosen) == k:
                    break
        return tuple(chosen)


def synthetic(pop: Population, *, node_users: int, requests: int, k: int, user_zipf: float, memory_zipf: float,
              requests_per_s: float, seed: int) -> Trace:
    """``requests`` requests to one node holding ``node_users`` users: its daily active share asks, by Zipf
    rank (``user_zipf``), for k memories each (``memory_zipf`` over the user's memories)."""
    if requests < 1 or k < 1 or node_users < 1 or requests_per_s <= 0:
        raise ConfigError("workload: requests, k and users must be >= 1 and the request rate > 0")
    rng = np.random.default_rng(seed)
    memories = pop.draw_memories(rng, node_users)
    active = rng.permutation(node_users)[: max(1, round(node_users * pop.daily_active))]
    users = active[np.searchsorted(np.cumsum(_zipf(len(active), user_zipf)), rng.random(requests), side="right")
                   .clip(max=len(active) - 1)]
    pick = _Retrieval(rng, memory_zipf)
    reqs = [Request(int(u), pick.pick(int(memories[u]), k)) for u in users]
    return Trace(memories, reqs, requests / requests_per_s)


def _rows(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return list(csv.DictReader(text.splitlines()))


def from_file(path: Path, pop: Population, *, memory_zipf: float, seed: int) -> Trace:
    """A trace of requests (CSV with a header, or JSONL): ``user``, ``k``, ``time`` (seconds), and optionally
    ``memories`` (the user's count; else drawn from the population's distribution)."""
    try:
        rows = _rows(Path(path))
        rows.sort(key=lambda r: float(r["time"]))
        ids = {u: i for i, u in enumerate(dict.fromkeys(str(r["user"]) for r in rows))}
        ks = [int(r["k"]) for r in rows]
        times = [float(r["time"]) for r in rows]
        given = {ids[str(r["user"])]: int(r["memories"]) for r in rows if r.get("memories") not in (None, "")}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"trace {path}: {e} (expected user, k, time[, memories])") from None
    if not rows or min(ks) < 1:
        raise ConfigError(f"trace {path}: no requests, or a k below 1")
    rng = np.random.default_rng(seed)
    memories = pop.draw_memories(rng, len(ids))
    for i, m in given.items():
        memories[i] = max(1, m)
    pick = _Retrieval(rng, memory_zipf)
    users = [ids[str(r["user"])] for r in rows]
    reqs = [Request(u, pick.pick(int(memories[u]), k)) for u, k in zip(users, ks)]
    return Trace(memories, reqs, max(times[-1] - times[0], 1e-9))
