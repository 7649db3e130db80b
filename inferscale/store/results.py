"""What store calls report: FetchStats (one get_many) and PullResult (one import or peer pull)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only
    from inferscale.kvformat import KVBlock
    from inferscale.store.tier import Key, TransferMeter


@dataclass
class FetchStats:
    """What one get_many cost: which tier served each block, bytes served, wall time."""

    tiers: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "dram": 0, "disk": 0})
    bytes: int = 0  # kv bytes of the blocks returned
    bytes_read: int = 0  # blob bytes brought up from disk
    seconds: float = 0.0
    served: dict[str, str] = field(default_factory=dict)  # item id -> tier
    tier_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes it moved (disk: blob bytes read)
    tier_seconds: dict[str, float] = field(default_factory=dict)  # tier -> seconds its share of the call took

    def as_attributes(self, prefix: str = "kv.") -> dict[str, int | float]:
        """Flat attributes for a tracing span."""
        out: dict[str, int | float] = {f"{prefix}tier.{k}": v for k, v in self.tiers.items()}
        out.update({f"{prefix}blocks": sum(self.tiers.values()), f"{prefix}bytes": self.bytes,
                    f"{prefix}bytes_read": self.bytes_read, f"{prefix}seconds": self.seconds})
        return out


@dataclass
class PullResult:
    tenant: str
    user: str
    blocks: int
    bytes: int
    tier: str  # where the blocks now are: "dram" (or "disk" when they did not fit)
    seconds: float
    total_blocks: int = 0  # the user's totals on this node after the call (what /internal/v1/pull reports)
    total_bytes: int = 0
    total_tokens: int = 0


def meter_fetch(stats: FetchStats, out: dict[Key, KVBlock], meters: dict[str, TransferMeter], gpu_s: float,
                rest_s: float, disk_s: float) -> None:
    """Per-tier bytes and seconds of one get_many, into its FetchStats and the tiers' ``meters``. Disk: the
    batched disk-to-DRAM load (metered where it happens, for every caller); DRAM: the rest of bringing up the
    non-device blocks (views, copies)."""
    kv_bytes = {tier: 0 for tier in stats.tiers}
    for k, b in out.items():
        kv_bytes[stats.served[k[3]]] += b.nbytes
    kv_bytes["disk"] = stats.bytes_read
    seconds = {"gpu": gpu_s, "disk": disk_s, "dram": max(0.0, rest_s - disk_s)}
    for tier, n in stats.tiers.items():
        stats.tier_bytes[tier], stats.tier_seconds[tier] = kv_bytes[tier], seconds[tier] if n else 0.0
        if tier != "disk" and tier in meters:
            meters[tier].record(n, kv_bytes[tier], stats.tier_seconds[tier])
