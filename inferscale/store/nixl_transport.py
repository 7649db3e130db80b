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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from inferscale.errors import ConfigError, TransferError
from inferscale.store.arena import Arena, align_up

log = logging.getLogger(__name__)
PULLER_WRITES = 16  # exposures a loaded puller view accumulates before it is loaded afresh
PULLER_IDLE_S = 5.0  # a puller view unused this long is dropped
WRITE_LANES = min(2, os.cpu_count() or 1)  # agents an owner WRITEs through side by side (NixlTransport.write_to)
LANE_MIN_BYTES = 4 << 20  # a lane's share below this is not worth a thread hand-off


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
                 ucx_port_range: str | None = None, write_lanes: int = WRITE_LANES) -> None:
        if ucx_port_range:
            # UCX's TCP transport picks its listening ports from this range (a NetworkPolicy can name them). UCX
            # reads it when the backend's context is created, below; an operator's own setting wins.
            os.environ.setdefault("UCX_TCP_PORT_RANGE", ucx_port_range)
        nixl = _import_nixl()
        self.name = name or f"inferscale-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        # No progress thread: this wheel's thread busy-polls (about 2/3 of a core per idle agent). Initiators
        # progress while they wait; a puller progresses while it awaits a peer's WRITE (``progress``).
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
        self.lanes = [WriteLane(self.agent, self.lock, arena)] if self.has_ucx else []
        for i in range(1, write_lanes if self.has_ucx else 0):
            lane = WriteLane.own(nixl, f"{self.name}-lane{i}", arena)
            if lane is None:
                break
            self.lanes.append(lane)
        self._pool = ThreadPoolExecutor(max(1, len(self.lanes) - 1), thread_name_prefix="nixl-lane")

    @property
    def has_posix(self) -> bool:
        return "POSIX" in self.backends

    @property
    def has_ucx(self) -> bool:
        return "UCX" in self.backends

    # -- transfers ------------------------------------------------------------------------------------------
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
                run_xfer(self.agent, local, remote, self.name, "disk read", ["POSIX"], self._deadline(timeout_s))
            finally:
                self.agent.deregister_memory(reg, backends=["POSIX"])

    # -- peer transfers ---------------------------------------------------------------------------------------
    def expose(self, offsets: list[int], sizes: list[int]) -> Exposure:
        """Register the arena slots (offset, size) with UCX for one incoming transfer (the puller's side): one
        region per run of slots that follow one another (the usual case for one pull's reservation), so the
        metadata the owner loads names a few regions, not one per block."""
        ranges = [(self.arena.base + off, n) for off, n in zip(offsets, sizes)]
        regions = [(self.arena.base + off, n, 0, "") for off, n in slot_runs(offsets, sizes)]
        with self.lock:
            reg = self.agent.register_memory(regions, "DRAM", backends=["UCX"])
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
                 timeout_s: float | None = None) -> int:
        """WRITE arena ranges ``sources`` (offset, size) into a puller's exposed ``remote`` (address, size); the
        number of lanes it went in, each one UCX request of its own agent (``WriteLane``), posted side by side: a
        CMA copy runs on the core of the thread that posts it, so one request left the other core idle (24.7 MB
        to another process: 2.0 ms in one lane, 1.3 ms in two). Returns once every lane is DONE, which NIXL's UCX
        backend reports after flushing the endpoint: the bytes have landed at the puller (UCX's flush completes
        remotely), so the owner's reply that follows needs no notification beside it."""
        nbytes = sum(n for _, n in sources)
        parts = split_ranges(list(zip(sources, remote)), max(1, min(len(self.lanes), nbytes // LANE_MIN_BYTES)))
        deadline = self._deadline(timeout_s)
        futures = [self._pool.submit(lane.write, metadata, part, deadline)
                   for lane, part in zip(self.lanes[1:], parts[1:])]
        errors: list[TransferError] = []
        try:
            self.lanes[0].write(metadata, parts[0], deadline)
        except TransferError as e:
            errors.append(e)
        for f in futures:  # every lane is waited for: none may still be copying when this returns
            try:
                f.result()
            except TransferError as e:
                errors.append(e)
        if errors:
            if any(getattr(e, "inflight", False) for e in errors):
                errors[0].inflight = True  # type: ignore[attr-defined]  # the puller must not reuse its slots
            raise errors[0]
        return len(parts)

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def progress(self) -> None:
        """Progress the agent: UCX's TCP transport lands a peer's WRITE only while its target progresses (CMA and
        RDMA do not need it)."""
        with self.lock:
            self.agent.get_new_notifs()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for lane in self.lanes:
            lane.close()
        with self.lock:
            try:
                if self._arena_reg is not None:
                    self.agent.deregister_memory(self._arena_reg, backends=list(self.backends))
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


def slot_runs(offsets: list[int], sizes: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of each run of arena slots that follow one another, a slot taking its aligned length (what
    the allocator reserved for it) when another follows: the runs cover those slots and nothing else."""
    runs: list[tuple[int, int]] = []
    for off, n in sorted(zip(offsets, sizes)):
        if runs and runs[-1][0] + align_up(runs[-1][1]) == off:
            start, length = runs[-1]
            runs[-1] = (start, off + n - start)
        else:
            runs.append((off, n))
    return runs


def split_ranges(pairs: list[tuple[tuple[int, int], tuple[int, int]]], parts: int
                 ) -> list[list[tuple[int, int, int]]]:
    """Cut ((source offset, size), (destination address, size)) pairs into ``parts`` runs of (source offset,
    destination address, size) of equal bytes (within one), a range cut where a run ends."""
    total = sum(n for (_, n), _ in pairs)
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    lane, room = 0, -(-total // parts)
    for (off, n), (addr, _) in pairs:
        while n > 0:
            take = min(n, room) if lane < parts - 1 else n
            runs[lane].append((off, addr, take))
            off, addr, n, room = off + take, addr + take, n - take, room - take
            if room == 0 and lane < parts - 1:
                lane, room = lane + 1, -(-total // parts)
    return [r for r in runs if r] or [[]]


class WriteLane:
    """One NIXL agent WRITEing arena bytes into pullers' exposures: its own UCX worker, lock and loaded views
    of pullers. Lane 0 is the transport's own agent; the others have agents of their own (``own``), registered
    with UCX over the arena as a source only."""

    def __init__(self, agent, lock: threading.Lock, arena: Arena, reg: object = None) -> None:
        self.agent, self.lock, self.arena_base, self.reg = agent, lock, arena.base, reg
        self.pullers: dict[str, tuple[int, float]] = {}  # loaded puller views: name -> (writes, last write)

    @classmethod
    def own(cls, nixl, name: str, arena: Arena) -> WriteLane | None:
        """A lane with an agent of its own, or None when UCX will not start for it (fewer lanes, not an error)."""
        try:
            agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
            agent.create_backend("UCX")
            reg = agent.register_memory([(arena.base, arena.size, 0, "arena")], "DRAM", backends=["UCX"])
        except Exception as e:  # noqa: BLE001 - reported; the transport writes in the lanes it has
            log.warning("NIXL write lane %s failed to start: %s", name, e)
            return None
        return cls(agent, threading.Lock(), arena, reg)

    def write(self, metadata: bytes, run: list[tuple[int, int, int]], deadline: float) -> None:
        """WRITE ``run`` [(arena offset, puller address, size)] as one UCX request."""
        with self.lock:
            puller = self._puller(metadata)
            local = self.agent.get_xfer_descs([(self.arena_base + off, n, 0) for off, _, n in run], "DRAM")
            remote = self.agent.get_xfer_descs([(addr, n, 0) for _, addr, n in run], "DRAM")
            run_xfer(self.agent, local, remote, puller, "peer write", ["UCX"], deadline, op="WRITE")

    def _puller(self, metadata: bytes) -> str:
        """Load a puller's metadata; its agent name. Called with the lock held. A puller's view stays loaded for
        its next writes (reconnecting its UCX endpoint on every pull cost about 1 ms), for at most
        ``PULLER_WRITES`` exposures and ``PULLER_IDLE_S`` between writes: the exposures this owner's library
        accepts for a puller are its last few, never its other memory (bytes go only to the ranges a write
        names, which the puller sent)."""
        now = time.monotonic()
        for name, (_, last) in list(self.pullers.items()):
            if now - last > PULLER_IDLE_S:
                self._forget(name)
        agent = self._load(metadata)
        writes = self.pullers.get(agent, (0, now))[0] + 1
        if writes > PULLER_WRITES:  # start its view afresh: only this exposure
            self._forget(agent)
            agent, writes = self._load(metadata), 1
        self.pullers[agent] = (writes, now)
        return agent

    def _load(self, metadata: bytes) -> str:
        try:
            return self.agent.add_remote_agent(metadata)
        except Exception as e:
            raise TransferError(f"puller agent metadata rejected: {e}") from None

    def _forget(self, agent: str) -> None:
        self.pullers.pop(agent, None)
        try:
            self.agent.remove_remote_agent(agent)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def close(self) -> None:
        with self.lock:
            for name in list(self.pullers):
                self._forget(name)
            if self.reg is not None:  # an agent of its own (lane 0's registration is the transport's)
                try:
                    self.agent.deregister_memory(self.reg, backends=["UCX"])
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass


def run_xfer(agent, local, remote, remote_agent: str, what: str, backends: list[str], deadline: float,
             op: str = "READ") -> None:
    """Post one NIXL request and wait for it until ``deadline`` (monotonic). A TransferError carries
    ``inflight = True`` when the request could not be released (its buffers must not be reused)."""
    handle, err = None, None
    try:
        handle = agent.initialize_xfer(op, local, remote, remote_agent, backends=backends)
        if agent.transfer(handle) == "ERR":
            raise TransferError(f"{what}: NIXL could not post the transfer")
        _wait_xfer(agent, handle, what, deadline)
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


def _wait_xfer(agent, handle, what: str, deadline: float) -> None:
    spins = 0
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state == "ERR":
            raise TransferError(f"{what}: NIXL transfer failed")
        if time.monotonic() > deadline:
            raise TransferError(f"{what}: NIXL transfer timed out")
        spins += 1
        if spins > 200:  # spin briefly (small transfers finish in microseconds), then stop burning a core
            time.sleep(0.0002)
