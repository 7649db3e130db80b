"""The owner's leases (G4): blocks held DRAM-resident for one peer session until they are written to the puller,
released, or the session ends; bounded per peer and per tenant in count and in held bytes, so no peer (and no
tenant's pulls) can pin the DRAM tier for everyone else."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from inferscale.errors import QuotaExceededError
from inferscale.store.tiers import DramEntry

LEASE_SECONDS = 30.0  # a lease not written by then is refused (the session may still be open)


@dataclass(frozen=True)
class LeaseCaps:
    per_peer: int = 16
    per_tenant: int = 32
    peer_bytes: int = 1 << 30
    tenant_bytes: int = 1 << 30

    @staticmethod
    def for_arena(size: int) -> LeaseCaps:
        """Defaults for a DRAM arena of ``size`` bytes: a peer may hold half of it, a tenant's leases a quarter."""
        return LeaseCaps(peer_bytes=max(1, size // 2), tenant_bytes=max(1, size // 4))


@dataclass
class Lease:
    id: str
    session: str
    peer: str
    tenant: str
    entries: list[DramEntry]
    nbytes: int
    expires: float = field(default_factory=lambda: time.monotonic() + LEASE_SECONDS)


class LeaseBook:
    """Open leases; ``release_entry`` gives a held DRAM entry back (the DRAM tier's release)."""

    def __init__(self, caps: LeaseCaps, release_entry: Callable[[DramEntry], None]) -> None:
        self.caps = caps
        self.release_entry = release_entry
        self.lock = threading.Lock()
        self.leases: dict[str, Lease] = {}

    def open(self, session: str, peer: str, tenant: str, entries: list[DramEntry]) -> Lease:
        """A lease over ``entries`` (their references pass to the lease). QuotaExceededError, the references
        released, when the peer or the tenant already holds its share."""
        nbytes = sum(e.size for e in entries)
        with self.lock:
            over = self._over(peer, tenant, nbytes)
            if over is None:
                lease = Lease(uuid.uuid4().hex, session, peer, tenant, entries, nbytes)
                self.leases[lease.id] = lease
                return lease
        for e in entries:
            self.release_entry(e)
        raise QuotaExceededError(f"lease refused: {over}; retry when its transfers are done")

    def _over(self, peer: str, tenant: str, nbytes: int) -> str | None:
        """Why one more lease of ``nbytes`` would exceed a cap, or None."""
        mine = [x for x in self.leases.values() if x.peer == peer]
        theirs = [x for x in self.leases.values() if x.tenant == tenant]
        c = self.caps
        if len(mine) >= c.per_peer:
            return f"peer {peer} holds {len(mine)} leases"
        if sum(x.nbytes for x in mine) + nbytes > c.peer_bytes:
            return f"peer {peer} would hold over {c.peer_bytes} leased bytes"
        if len(theirs) >= c.per_tenant:
            return f"tenant {tenant!r} has {len(theirs)} leases out"
        if sum(x.nbytes for x in theirs) + nbytes > c.tenant_bytes:
            return f"tenant {tenant!r} would have over {c.tenant_bytes} leased bytes out"
        return None

    def take(self, lease_id: object, session: str) -> Lease | None:
        """Remove and return the session's lease ``lease_id`` (None when unknown, another session's, or
        expired: an expired one is ended here)."""
        with self.lock:
            lease = self.leases.get(lease_id) if isinstance(lease_id, str) else None
            if lease is None or lease.session != session:
                return None
            del self.leases[lease.id]
        if lease.expires < time.monotonic():
            self.end(lease)
            return None
        return lease

    def finish(self, lease: Lease) -> None:
        """End ``lease`` and drop it from the book (it counted against the caps until now)."""
        with self.lock:
            self.leases.pop(lease.id, None)
        self.end(lease)

    def end(self, lease: Lease) -> None:
        for e in lease.entries:
            self.release_entry(e)
        lease.entries = []

    def end_session(self, session: str) -> None:
        with self.lock:
            gone = [x for x in self.leases.values() if x.session == session]
            for x in gone:
                del self.leases[x.id]
        for x in gone:
            self.end(x)

    def end_all(self) -> None:
        with self.lock:
            gone, self.leases = list(self.leases.values()), {}
        for x in gone:
            self.end(x)
