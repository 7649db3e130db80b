"""Peer sessions kept open between pulls (keep-alive, the puller's side): a pull in a kept session skips the TCP
connect and the hello round trip (inferscale/store/peer.py), which on a loaded node cost as much as the lease's
round trips themselves.

Only a session whose last exchange ended cleanly goes back (a failed pull closes its session, which ends any
lease the peer still holds for it); a kept one is dropped after ``idle_s`` (the peer may have timed it out) or
before it would pass the peer's request limit. A kept session the peer has closed meanwhile fails on first use;
``PeerSessions.call_fresh`` then sends that first request once more in a new session (harmless: a lease the
first try may have opened ends with the closed session)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from inferscale.errors import TransferError
from inferscale.fleettls import FleetTls
from inferscale.store.peer import MAX_REQUESTS_PER_SESSION, PeerSession

IDLE_S = 2.0  # well under any peer's session timeout
PER_PEER = 2  # kept sessions per peer; each holds one of the peer's session slots


class PeerSessions:
    def __init__(self, idle_s: float = IDLE_S, per_peer: int = PER_PEER, tls: FleetTls | None = None) -> None:
        self.idle_s, self.per_peer = idle_s, per_peer
        self.tls = tls  # every new session is wrapped in the fleet's TLS when it has certificates
        self.lock = threading.Lock()
        self.kept: dict[tuple[str, str], list[tuple[float, PeerSession]]] = {}

    def take(self, peer: str, secret: str, timeout_s: float) -> tuple[PeerSession, bool]:
        """(a session with ``peer``, whether it was kept): a kept one if any is fresh, else a new one."""
        now, stale = time.monotonic(), []
        with self.lock:
            kept = self.kept.get((peer, secret), [])
            while kept:
                at, s = kept.pop()
                if now - at <= self.idle_s:
                    break
                stale.append(s)
            else:
                s = None
        for x in stale:
            x.close()
        return (s, True) if s is not None else (PeerSession(peer, secret, timeout_s, self.tls), False)

    def give_back(self, session: PeerSession, requests_next: int) -> None:
        """Keep ``session`` for a later pull of ``requests_next`` requests (closed when it could not take them)."""
        if session.seq + requests_next > MAX_REQUESTS_PER_SESSION:
            session.close()
            return
        with self.lock:
            kept = self.kept.setdefault((session.peer, session.secret), [])
            if len(kept) < self.per_peer:
                kept.append((time.monotonic(), session))
                return
        session.close()

    def call_fresh(self, peer: str, secret: str, timeout_s: float, msg: dict[str, Any],
                   progress: Callable[[], object] | None = None) -> tuple[PeerSession, dict[str, Any]]:
        """The first request of a pull: in a kept session, or a new one when the kept one turns out closed."""
        session, kept = self.take(peer, secret, timeout_s)
        try:
            return session, session.call(msg, progress)
        except TransferError:
            session.close()
            if not kept:
                raise
        session = PeerSession(peer, secret, timeout_s, self.tls)
        try:
            return session, session.call(msg, progress)
        except BaseException:
            session.close()
            raise

    def close(self) -> None:
        with self.lock:
            kept, self.kept = self.kept, {}
        for sessions in kept.values():
            for _, s in sessions:
                s.close()
