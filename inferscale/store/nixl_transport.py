"""NIXL (``nixl-cu12``) as the one engine that moves blob bytes: POSIX backend for disk -> DRAM, UCX for
peer DRAM -> local DRAM (and, on GPU nodes, VRAM). The DRAM arena is registered once at start.

A NIXL agent is not thread-safe in its default sync mode, so every agent call goes through one lock; transfers
are batched (one request per get/pull), so serialising them costs little. Every wait has a deadline."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

from inferscale.errors import ConfigError, TransferError
from inferscale.store.arena import Arena

log = logging.getLogger(__name__)


def _import_nixl():
    try:
        import nixl_cu12  # the CUDA 12 wheel; bundles UCX and the POSIX plugin
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ConfigError(f"NIXL is not installed (pip install nixl-cu12==1.5.1): {e}") from None
    return nixl_cu12


class NixlTransport:
    def __init__(self, arena: Arena, *, name: str | None = None, timeout_s: float = 10.0) -> None:
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
        # One registration for the whole arena, with every backend that handles DRAM.
        self._arena_reg = self.agent.register_memory([(arena.base, arena.size, 0, "arena")], "DRAM")
        self._remotes: dict[str, str] = {}  # metadata digest -> remote agent name

    @property
    def has_posix(self) -> bool:
        return "POSIX" in self.backends

    @property
    def has_ucx(self) -> bool:
        return "UCX" in self.backends

    def metadata(self) -> bytes:
        with self.lock:
            return self.agent.get_agent_metadata()

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

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer agent's metadata (idempotent); returns its agent name."""
        key = str(hash(metadata))
        with self.lock:
            if key not in self._remotes:
                try:
                    self._remotes[key] = self.agent.add_remote_agent(metadata)
                except Exception as e:
                    raise TransferError(f"peer agent metadata rejected: {e}") from None
            return self._remotes[key]

    def forget_remote(self, name: str) -> None:
        with self.lock:
            for k, v in list(self._remotes.items()):
                if v == name:
                    del self._remotes[k]
                    try:
                        self.agent.remove_remote_agent(name)
                    except Exception:  # noqa: BLE001 - already gone
                        pass

    def read_remote(self, remote_agent: str, remote: list[tuple[int, int]], offsets: list[int],
                    timeout_s: float | None = None, notif: bytes = b"") -> None:
        """READ peer ranges (address, size) into arena ``offsets``: one UCX request for the batch. ``notif``
        reaches the peer once the data has been read (it ends the peer's lease)."""
        if not remote:
            return
        with self.lock:
            local = self.agent.get_xfer_descs(
                [(self.arena.base + off, size, 0) for (_, size), off in zip(remote, offsets)], "DRAM")
            rdescs = self.agent.get_xfer_descs([(addr, size, 0) for addr, size in remote], "DRAM")
            self._run(local, rdescs, remote_agent, "peer read", ["UCX"], timeout_s, notif)

    def poll_notifs(self) -> list[bytes]:
        """Progress the agent and return notifications that arrived (from any peer)."""
        with self.lock:
            got = self.agent.get_new_notifs()
        return [m for msgs in got.values() for m in msgs]

    def close(self) -> None:
        with self.lock:
            try:
                self.agent.deregister_memory(self._arena_reg)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
