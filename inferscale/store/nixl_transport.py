"""NIXL (``nixl-cu12``) as the one engine that moves blob bytes: POSIX backend for disk -> DRAM, UCX for
peer DRAM -> peer DRAM (and, on GPU nodes, VRAM).

What a peer can reach: nothing of a serving node. UCX's TCP and shared-memory transports do not check a remote
read against the registration it names (a reader that patches the address in a node's metadata reads any byte of
that process), so no serving node hands out its metadata at all. Bytes move the other way: the puller registers
exactly its destination slots for one transfer and sends that (partial) metadata to the owner, over an
authenticated session (inferscale/store/peer.py), only after the owner proved the peer secret; the owner's own
library WRITEs exactly the leased blocks into them. The DRAM arena is registered with POSIX (disk reads) and with
UCX as a source only; its descriptors never leave the process.

A NIXL agent is not thread-safe in its default sync mode, so every agent call goes through one lock; transfers
are batched (one request per get/pull), so serialising them costs little. Every wait has a deadline."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

from inferscale.errors import ConfigError, TransferError
from inferscale.store.arena import Arena

log = logging.getLogger(__name__)
PULLER_WRITES = 16  # exposures a loaded puller view accumulates before it is loaded afresh
PULLER_IDLE_S = 5.0  # a puller view unused this long is dropped


@dataclass
class Exposure:
    """A puller's destination slots, registered with UCX for one transfer."""

    reg: object
    metadata: bytes  # partial agent metadata: connection info + this registration only
    ranges: list[tuple[int, int]]  # (address, size) of each destination slot


def _import_nixl():
    try:
        import nixl_cu12  # the CUDA 12 wheel; bundles UCX and the POSIX plugin
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ConfigError(f"NIXL is not installed (pip install nixl-cu12==1.5.1): {e}") from None
    return nixl_cu12


class NixlTransport:
    def __init__(self, arena: Arena, *, name: str | None = None, timeout_s: float = 10.0,
                 ucx_port_range: str | None = None) -> None:
        if ucx_port_range:
            # UCX's TCP transport picks its listening ports from this range (a NetworkPolicy can name them). UCX
            # reads it when the backend's context is created, below; an operator's own setting wins.
            os.environ.setdefault("UCX_TCP_PORT_RANGE", ucx_port_range)
        nixl = _import_nixl()
        self.name = name or f"inferscale-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        # No progress thread: this wheel's thread busy-polls (about 2/3 of a core per idle agent). Initiators
        # progress while they wait; a puller progresses while it awaits a peer's WRITE (wait_notif).
        cfg = nixl.nixl_agent_config(enable_prog_thread=False, backends=[])
        self.agent = nixl.nixl_agent(self.name, cfg)
        plugins = self.agent.get_plugin_list()
        self.backends: list[str] = []
        for b in ("UCX", "POSIX"):
            if b not in plugins:
                log.warning("NIXL plugin %s missing; %s transfers fall back to plain I/O", b, b)
                continue
            try:
                self.agent.create_backend(b)
                self.backends.append(b)
            except Exception as e:  # noqa: BLE001 - a backend that cannot start is reported, not fatal
                log.warning("NIXL backend %s failed to start: %s", b, e)
        self.arena = arena
        # Registered for local disk reads and as the source of this node's WRITEs; never described to a peer.
        self._arena_reg = None
        if self.backends:
            self._arena_reg = self.agent.register_memory([(arena.base, arena.size, 0, "arena")], "DRAM",
                                                         backends=list(self.backends))
        self._notifs: set[bytes] = set()  # arrived, not yet claimed by wait_notif
        self._pullers: dict[str, tuple[int, float]] = {}  # loaded puller views: name -> (writes, last write)

    @property
    def has_posix(self) -> bool:
        return "POSIX" in self.backends

    @property
    def has_ucx(self) -> bool:
        return "UCX" in self.backends

    # -- transfers ------------------------------------------------------------------------------------------
    def _wait(self, handle, what: str, deadline: float) -> None:
        spins = 0
        while True:
            state = self.agent.check_xfer_state(handle)
            if state == "DONE":
                return
            if state == "ERR":
                raise TransferError(f"{what}: NIXL transfer failed")
            if time.monotonic() > deadline:
                raise TransferError(f"{what}: NIXL transfer timed out after {self.timeout_s:.1f}s")
            spins += 1
            if spins > 200:  # spin briefly (small transfers finish in microseconds), then stop burning a core
                time.sleep(0.0002)

    def _run(self, local, remote, remote_agent: str, what: str, backends: list[str], timeout_s: float | None,
             notif: bytes = b"", op: str = "READ") -> None:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        handle, err = None, None
        try:
            handle = self.agent.initialize_xfer(op, local, remote, remote_agent, notif_msg=notif, backends=backends)
            if self.agent.transfer(handle) == "ERR":
                raise TransferError(f"{what}: NIXL could not post the transfer")
            self._wait(handle, what, deadline)
        except TransferError as e:
            err = e
            raise
        except Exception as e:  # nixl raises its own exception types from the bindings
            err = TransferError(f"{what}: {type(e).__name__}: {e}")
            raise err from None
        finally:
            if handle is not None:
                try:
                    handle.release()
                except Exception as e:  # noqa: BLE001 - an unfinished transfer may refuse to be released
                    log.warning("%s: releasing transfer handle: %s", what, e)
                    if err is not None:
                        err.inflight = True  # type: ignore[attr-defined]  # its buffers must not be reused

    def read_files(self, files: list[tuple[int, int]], offsets: list[int], timeout_s: float | None = None) -> None:
        """READ whole files (fd, size) into arena ``offsets``: one POSIX request for the batch."""
        if not files:
            return
        with self.lock:
            reg = self.agent.register_memory([(0, size, fd, "") for fd, size in files], "FILE", backends=["POSIX"])
            try:
                local = self.agent.get_xfer_descs(
                    [(self.arena.base + off, size, 0) for (fd, size), off in zip(files, offsets)], "DRAM")
                remote = self.agent.get_xfer_descs([(0, size, fd) for fd, size in files], "FILE")
                self._run(local, remote, self.name, "disk read", ["POSIX"], timeout_s)
            finally:
                self.agent.deregister_memory(reg, backends=["POSIX"])

    # -- peer transfers ---------------------------------------------------------------------------------------
    def expose(self, offsets: list[int], sizes: list[int]) -> Exposure:
        """Register the arena slots (offset, size) with UCX for one incoming transfer (the puller's side)."""
        ranges = [(self.arena.base + off, n) for off, n in zip(offsets, sizes)]
        with self.lock:
            reg = self.agent.register_memory([(a, n, 0, "") for a, n in ranges], "DRAM", backends=["UCX"])
            try:
                md = self.agent.get_partial_agent_metadata(reg, True, ["UCX"])
            except Exception:
                self.agent.deregister_memory(reg, backends=["UCX"])
                raise
        return Exposure(reg, md, ranges)

    def unexpose(self, exposure: Exposure) -> None:
        with self.lock:
            self.agent.deregister_memory(exposure.reg, backends=["UCX"])

    def write_to(self, metadata: bytes, sources: list[tuple[int, int]], remote: list[tuple[int, int]],
                 notif: bytes, timeout_s: float | None = None) -> None:
        """WRITE arena ranges ``sources`` (offset, size) into a puller's exposed ``remote`` (address, size), one
        UCX request; ``notif`` reaches the puller once the bytes have landed. The puller's metadata (its
        connection and this exposure) is loaded into a kept view of that puller (see ``_puller``)."""
        with self.lock:
            agent = self._puller(metadata)
            local = self.agent.get_xfer_descs([(self.arena.base + off, n, 0) for off, n in sources], "DRAM")
            rdescs = self.agent.get_xfer_descs([(addr, n, 0) for addr, n in remote], "DRAM")
            self._run(local, rdescs, agent, "peer write", ["UCX"], timeout_s, notif, op="WRITE")

    def _puller(self, metadata: bytes) -> str:
        """Load a puller's metadata; its agent name. Called with the lock held. A puller's view stays loaded for
        its next writes (reconnecting its UCX endpoint on every pull cost about 1 ms), for at most
        ``PULLER_WRITES`` exposures and ``PULLER_IDLE_S`` between writes: the exposures this owner's library
        accepts for a puller are its last few, never its other memory (bytes go only to the ``remote`` a write
        names, which the puller sent)."""
        now = time.monotonic()
        for name, (_, last) in list(self._pullers.items()):
            if now - last > PULLER_IDLE_S:
                self._forget(name)
        try:
            agent = self.agent.add_remote_agent(metadata)
        except Exception as e:
            raise TransferError(f"puller agent metadata rejected: {e}") from None
        writes = self._pullers.get(agent, (0, now))[0] + 1
        if writes > PULLER_WRITES:  # start its view afresh: only this exposure
            self._forget(agent)
            try:
                agent = self.agent.add_remote_agent(metadata)
            except Exception as e:
                raise TransferError(f"puller agent metadata rejected: {e}") from None
            writes = 1
        self._pullers[agent] = (writes, now)
        return agent

    def _forget(self, agent: str) -> None:
        self._pullers.pop(agent, None)
        try:
            self.agent.remove_remote_agent(agent)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def wait_notif(self, msg: bytes, deadline: float) -> bool:
        """Progress the agent until notification ``msg`` has arrived (True) or ``deadline`` (monotonic) passed."""
        while True:
            self.poll_notifs()
            with self.lock:
                if msg in self._notifs:
                    self._notifs.discard(msg)
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0001)

    def poll_notifs(self) -> None:
        """Progress the agent; notifications that arrived wait for wait_notif (bounded: a flood is dropped)."""
        with self.lock:
            got = self.agent.get_new_notifs()
            if len(self._notifs) > 4096:
                self._notifs.clear()
            self._notifs.update(m for msgs in got.values() for m in msgs)

    def close(self) -> None:
        with self.lock:
            for name in list(self._pullers):
                self._forget(name)
            try:
                if self._arena_reg is not None:
                    self.agent.deregister_memory(self._arena_reg, backends=list(self.backends))
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
