"""Run a store as a peer node in a child process (multiprocessing spawn): used by tests and the benchmark to
put a second NIXL agent in a second process on loopback."""

from __future__ import annotations

import os
from typing import Any


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
