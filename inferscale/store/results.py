"""What store calls report: FetchStats (one get_many) and PullResult (one import or peer pull)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
