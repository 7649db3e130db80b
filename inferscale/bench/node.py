"""Run a store as a peer node in a child process (multiprocessing spawn): used by tests and the benchmark to
put a second NIXL agent in a second process on loopback."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def child_process(
    target: Callable[..., None], *args: Any, start_timeout_s: float = 60.0, stop_timeout_s: float = 15.0
) -> Iterator[Any]:
    """Run ``target(*args, conn)`` in a spawned process; yield the first message it sends on ``conn``.

    On exit the child is told "stop" and joined, and killed if it outlives ``stop_timeout_s``: never a hang."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(start_timeout_s):
            raise RuntimeError(f"{getattr(target, '__name__', 'child')} did not start in {start_timeout_s:.0f} s")
        yield parent.recv()
    finally:
        try:
            parent.send("stop")
        except OSError:
            pass
        proc.join(stop_timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def serve_node(root: str, options: dict[str, Any], conn: Any) -> None:
    """Open ``root`` with a peer service on 127.0.0.1, make ``options['preload']`` [(tenant, user, fingerprint)]
    DRAM-resident, send {"peer", "pid"} on ``conn``, then serve until ``conn`` says "stop" or closes."""
    from inferscale.store.store import KVStore

    options = dict(options)
    preload = options.pop("preload", [])
    store = KVStore(root, peer_port=0, peer_host="127.0.0.1", node="127.0.0.1", **options)
    try:
        for tenant, user, fp in preload:
            ids = [i.item_id for i in store.list(tenant, user) if i.fingerprint == fp]
            store.get_many(tenant, user, ids, fp)
        conn.send({"peer": store.peer_address, "pid": os.getpid()})
        while True:
            try:
                if conn.recv() == "stop":
                    break
            except EOFError:
                break
    finally:
        store.close()
