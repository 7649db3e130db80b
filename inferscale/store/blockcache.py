"""Per-block cache policy for one tier (HBM or DRAM): which blocks a tier keeps, in bytes, per tenant.

The policy only decides; the tier that adopts it moves the bytes. Pure Python, no torch, no clock: the caller
passes each block's size, and every counter is in blocks and bytes.

- Admission (TinyLFU, Einziger et al. 2017; as Ristretto does it): a block enters a full tier only when the
  frequency sketch says it is wanted at least as often as every block it would push out, so a block touched once
  never displaces a hot one (ties admit: among equally cold blocks the tier stays LRU instead of freezing, the
  job Caffeine's admission window does). Every lookup, hit or miss, counts in the sketch.
- Eviction: least recently used first, among the blocks the candidate may evict.
- Tenant shares: a tenant over its share evicts only its own blocks; while within it, anyone's. So a tenant never
  evicts another beyond its share (the same rule as ``store.tiers`` today).
- Pins: a pinned block (counted: one pin per in-flight request that reads it) is never evicted.

Hand-written rather than a library: the cache libraries here (cachetools, theine) key by item count, not bytes,
and have neither pins nor tenant shares; the sketch libraries (pyprobables) have no aging, which TinyLFU needs.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from inferscale.errors import ConfigError

MASK64 = (1 << 64) - 1
# Odd 64-bit multipliers: one independent-enough hash per sketch row from one ``hash(key)``.
ROW_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
COUNTER_MAX = 15  # 4-bit counters, as in Caffeine: frequency past 15 does not matter for admission
HALVE = bytes(b >> 1 for b in range(256))  # bytearray.translate table: every counter halved at C speed
# A small tier's sketch still gets this many counters a row (4 KiB in all): with 16, a scan of 50 one-touch blocks
# collided with a hot block in all four rows often enough (about one run in six) to push it out.
MIN_SKETCH_WIDTH = 1024
SAMPLE_FACTOR = 10  # halve after width × this many increments (TinyLFU's sample size W)


class FrequencySketch:
    """Count-min sketch of how often each key was seen lately: 4 rows of 4-bit counters, all halved every
    ``sample`` increments so old popularity fades (TinyLFU's reset)."""

    def __init__(self, width: int) -> None:
        if width < 1:
            raise ConfigError(f"frequency sketch width {width} must be positive")
        self.bits = max(4, (width - 1).bit_length())  # width rounded up to a power of two
        self.rows = [bytearray(1 << self.bits) for _ in ROW_SEEDS]
        self.sample = SAMPLE_FACTOR << self.bits
        self.additions = 0

    def _slots(self, key: Hashable) -> list[int]:
        h = hash(key) & MASK64
        shift = 64 - self.bits
        return [((h * seed) & MASK64) >> shift for seed in ROW_SEEDS]

    def add(self, key: Hashable) -> None:
        h, shift = hash(key) & MASK64, 64 - self.bits
        for row, seed in zip(self.rows, ROW_SEEDS):  # _slots, inlined: every read of every block comes here
            i = ((h * seed) & MASK64) >> shift
            if row[i] < COUNTER_MAX:
                row[i] += 1
        self.additions += 1
        if self.additions >= self.sample:
            self.rows = [bytearray(row.translate(HALVE)) for row in self.rows]
            self.additions //= 2

    def estimate(self, key: Hashable) -> int:
        return min(row[i] for row, i in zip(self.rows, self._slots(key)))


@dataclass
class CacheStats:
    """Counters of one tier's cache since it was made (blocks and bytes; no time)."""

    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    admitted: int = 0
    rejected: int = 0  # refused by the frequency filter, a share or pins
    evicted: int = 0
    evicted_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


@dataclass(frozen=True)
class Admission:
    """What ``admit`` did: whether the block is now resident, and the keys it pushed out (the tier drops their
    cached copies; disk keeps the blobs)."""

    admitted: bool
    evicted: tuple[Hashable, ...] = ()
    reason: str | None = None  # why refused: "filter" (less frequent), "room" (budget or pins), "share"


@dataclass
class _Entry:
    tenant: str
    size: int


@dataclass
class BlockCache:
    """Which blocks one tier holds, within ``budget_bytes``. ``tenant_shares`` overrides ``default_share`` (None:
    no per-tenant bound) per tenant. ``frequency_filter=False`` is plain LRU (what whole-user caching does today).
    Keys are any hashable the tier uses (the store's (tenant, user, fingerprint, item))."""

    budget_bytes: int
    default_share: int | None = None
    tenant_shares: Mapping[str, int | None] = field(default_factory=dict)
    frequency_filter: bool = True
    sketch_width: int = 0  # 0: sized from the budget and the first block's size
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ConfigError(f"cache budget {self.budget_bytes} bytes must not be negative")
        self._lru: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._tenant_bytes: dict[str, int] = defaultdict(int)
        self._pins: dict[Hashable, int] = defaultdict(int)
        self.used_bytes = 0
        self.sketch = FrequencySketch(self.sketch_width) if self.sketch_width else None

    # -- reads ----------------------------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, key: Hashable, size: int) -> bool:
        """A read of ``key`` (``size`` bytes): True on a hit (it becomes most recent). Hit or miss, it counts
        towards the key's frequency."""
        if self.frequency_filter:
            self._sketch(size).add(key)
        if key in self._lru:
            self._lru.move_to_end(key)
            self.stats.hits += 1
            self.stats.hit_bytes += size
            return True
        self.stats.misses += 1
        self.stats.miss_bytes += size
        return False

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes[tenant]

    def share(self, tenant: str) -> int | None:
        return self.tenant_shares.get(tenant, self.default_share)

    # -- pins -----------------------------------------------------------------------------------------------
    def pin(self, key: Hashable) -> None:
        """One more in-flight reader of ``key``: it is never evicted while pinned (pin before admitting)."""
        self._pins[key] += 1

    def unpin(self, key: Hashable) -> None:
        if self._pins.get(key, 0) <= 0:
            raise ConfigError(f"unpin of {key!r}, which is not pinned")
        self._pins[key] -= 1
        if not self._pins[key]:
            del self._pins[key]

    # -- writes ---------------------------------------------------------------------------------------------
    def admit(self, key: Hashable, tenant: str, size: int) -> Admission:
        """Offer ``key`` (``size`` bytes of ``tenant``) after a miss brought it to this tier. Resident already:
        refreshed. Otherwise it enters when there is room, or when every block it must evict (LRU first, among
        those its tenant may evict, never pinned) is less frequent than it; else it is refused and nothing moves."""
        if size < 0:
            raise ConfigError(f"block {key!r}: size {size} must not be negative")
        if key in self._lru:
            self._lru.move_to_end(key)
            return Admission(True)
        victims, reason = self._victims(key, tenant, size)
        if victims is None:
            self.stats.rejected += 1
            return Admission(False, reason=reason)
        for v in victims:
            self._drop(v, counted=True)
        self._lru[key] = _Entry(tenant, size)
        self._tenant_bytes[tenant] += size
        self.used_bytes += size
        self.stats.admitted += 1
        return Admission(True, tuple(victims))

    def shrink(self, key: Hashable, size: int) -> None:
        """A resident block turned out smaller than admitted (a sealed file opened to its plain image)."""
        e = self._lru.get(key)
        if e is not None and 0 <= size < e.size:
            self._tenant_bytes[e.tenant] -= e.size - size
            self.used_bytes -= e.size - size
            e.size = size

    def discard(self, key: Hashable) -> bool:
        """Drop ``key`` (its bytes changed or were deleted); True when it was resident. Not counted as eviction."""
        if key not in self._lru:
            return False
        self._drop(key, counted=False)
        return True

    def shed(self, tenant: str | None = None) -> Hashable | None:
        """Evict the least recent unpinned block (of ``tenant`` only, when given) whatever its frequency: the
        tier needs the room for bytes it holds outside the cache's count (a fragmented arena, a transfer's
        slots). None when every candidate is pinned."""
        for k, e in self._lru.items():
            if k not in self._pins and (tenant is None or e.tenant == tenant):
                self._drop(k, counted=True)
                return k
        return None

    def _victims(self, key: Hashable, tenant: str, size: int) -> tuple[list[Hashable] | None, str | None]:
        share = self.share(tenant)
        if size > self.budget_bytes:
            return None, "room"
        if share is not None and size > share:
            return None, "share"
        own_over = 0 if share is None else max(0, self._tenant_bytes[tenant] + size - share)
        victims = self._take(own_over, lambda e: e.tenant == tenant, [])
        if victims is None:
            return None, "share"
        freed = sum(self._lru[v].size for v in victims)
        overall = self.used_bytes - freed + size - self.budget_bytes
        victims = self._take(overall, lambda e: True, victims)
        if victims is None:
            return None, "room"
        if not victims or not self.frequency_filter:
            return victims, None
        sketch = self._sketch(size)
        wanted = sketch.estimate(key)
        return (victims, None) if all(sketch.estimate(v) <= wanted for v in victims) else (None, "filter")

    def _sketch(self, size: int) -> FrequencySketch:
        # Sized on first use for 4 counters per block the budget holds at this block size (TinyLFU's advice).
        if self.sketch is None:
            self.sketch = FrequencySketch(max(MIN_SKETCH_WIDTH, 4 * self.budget_bytes // max(size, 1)))
        return self.sketch

    def _take(self, need: int, eligible, chosen: list[Hashable]) -> list[Hashable] | None:
        """``chosen`` plus least recent eligible unpinned blocks until ``need`` more bytes are freed; None when
        pins (or the rule) leave too few."""
        taken = set(chosen)
        out = list(chosen)
        for k, e in self._lru.items():  # oldest first
            if need <= 0:
                break
            if k in taken or k in self._pins or not eligible(e):
                continue
            out.append(k)
            need -= e.size
        return out if need <= 0 else None

    def _drop(self, key: Hashable, *, counted: bool) -> None:
        e = self._lru.pop(key)
        self._tenant_bytes[e.tenant] -= e.size
        self.used_bytes -= e.size
        if counted:
            self.stats.evicted += 1
            self.stats.evicted_bytes += e.size
