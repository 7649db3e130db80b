"""NIXL (``nixl-cu12``) as the one engine that moves blob bytes: POSIX backend for disk -> DRAM, UCX for
peer DRAM -> local DRAM (and, on GPU nodes, VRAM).

What a peer can reach: the DRAM arena is registered with POSIX only (local disk reads), never with UCX, and this
agent's full metadata never leaves the process. A peer is handed a ``Lease``: a staging copy of exactly the
leased blocks, registered with UCX for that lease alone, described by partial metadata that names only it. At the
lease's end the copy is zeroed and deregistered (then kept, zeroed, for a grace period before it is freed, so a
stale descriptor neither reads tenant bytes nor faults this process). A puller registers its destination slots
for the duration of one READ and unloads the peer's metadata afterwards.

A NIXL agent is not thread-safe in its default sync mode, so every agent call goes through one lock; transfers
are batched (one request per get/pull), so serialising them costs little. Every wait has a deadline."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from inferscale.errors import ConfigError, TransferError
from inferscale.store.arena import Arena

log = logging.getLogger(__name__)


QUARANTINE_SECONDS = 60.0  # how long a released, zeroed lease buffer stays mapped before it is freed


@dataclass
class Lease:
    """One peer's view of this node: a staging copy of the leased blocks, registered with UCX while it lives."""

    buf: np.ndarray
    reg: object
    metadata: bytes  # partial agent metadata: connection info + this registration only
    ranges: list[tuple[int, int]]  # (address, size) of each block in ``buf``, in the order given


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
        # progress while they wait; a serving node progresses while it holds a lease (poll_notifs).
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
        # The arena is registered for local disk reads only: no UCX registration, so no peer can name it.
        self._arena_reg = None
        if self.has_posix:
            self._arena_reg = self.agent.register_memory([(arena.base, arena.size, 0, "arena")], "DRAM",
                                                         backends=["POSIX"])
        self._quarantine: collections.deque[tuple[float, np.ndarray]] = collections.deque()

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
             notif: bytes = b"") -> None:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        handle, err = None, None
        try:
            handle = self.agent.initialize_xfer("READ", local, remote, remote_agent, notif_msg=notif, backends=backends)
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

    # -- leases (the owner's side) ---------------------------------------------------------------------------
    def open_lease(self, images: list[memoryview]) -> Lease:
        """Copy ``images`` into a fresh staging buffer and register exactly it with UCX for one peer."""
        sizes = [len(m) for m in images]
        buf = np.empty(max(1, sum(sizes)), dtype=np.uint8)
        base, ranges, off = buf.ctypes.data, [], 0
        for m, n in zip(images, sizes):
            buf[off : off + n] = np.frombuffer(m, dtype=np.uint8)
            ranges.append((base + off, n))
            off += n
        with self.lock:
            reg = self.agent.register_memory([(base, buf.size, 0, "lease")], "DRAM", backends=["UCX"])
            try:
                md = self.agent.get_partial_agent_metadata(reg, True, ["UCX"])
            except Exception:
                self.agent.deregister_memory(reg, backends=["UCX"])
                raise
        return Lease(buf, reg, md, ranges)

    def close_lease(self, lease: Lease) -> None:
        """End a lease: zero its bytes, deregister them, and free them after the quarantine period."""
        lease.buf.fill(0)
        with self.lock:
            try:
                self.agent.deregister_memory(lease.reg, backends=["UCX"])
            except Exception as e:  # noqa: BLE001 - the bytes are zeroed either way
                log.warning("deregistering a lease: %s", e)
            now = time.monotonic()
            self._quarantine.append((now + QUARANTINE_SECONDS, lease.buf))
            while self._quarantine and self._quarantine[0][0] < now:
                self._quarantine.popleft()

    # -- pulls (the puller's side) ----------------------------------------------------------------------------
    def read_leased(self, metadata: bytes, remote: list[tuple[int, int]], offsets: list[int],
                    timeout_s: float | None = None, notif: bytes = b"") -> None:
        """READ a peer's leased ranges (address, size) into arena ``offsets``: one UCX request for the batch.
        The peer's (per-lease) metadata is loaded for this READ and unloaded after it; the destination slots
        are registered with UCX only meanwhile. ``notif`` reaches the peer once the data has been read."""
        if not remote:
            return
        local_ranges = [(self.arena.base + off, size) for (_, size), off in zip(remote, offsets)]
        with self.lock:
            try:
                agent = self.agent.add_remote_agent(metadata)
            except Exception as e:
                raise TransferError(f"peer agent metadata rejected: {e}") from None
            try:
                reg = self.agent.register_memory([(a, n, 0, "") for a, n in local_ranges], "DRAM", backends=["UCX"])
                try:
                    local = self.agent.get_xfer_descs([(a, n, 0) for a, n in local_ranges], "DRAM")
                    rdescs = self.agent.get_xfer_descs([(addr, size, 0) for addr, size in remote], "DRAM")
                    self._run(local, rdescs, agent, "peer read", ["UCX"], timeout_s, notif)
                finally:
                    self.agent.deregister_memory(reg, backends=["UCX"])
            finally:
                try:
                    self.agent.remove_remote_agent(agent)
                except Exception:  # noqa: BLE001 - already gone
                    pass

    def poll_notifs(self) -> list[bytes]:
        """Progress the agent and return notifications that arrived (from any peer)."""
        with self.lock:
            got = self.agent.get_new_notifs()
        return [m for msgs in got.values() for m in msgs]

    def close(self) -> None:
        with self.lock:
            try:
                if self._arena_reg is not None:
                    self.agent.deregister_memory(self._arena_reg, backends=["POSIX"])
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self._quarantine.clear()
