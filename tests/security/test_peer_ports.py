"""The peer data plane listens only where a NetworkPolicy can name it: UCX's TCP ports inside
INFERSCALE_UCX_PORT_RANGE (a real NIXL UCX agent in a fresh process, its listening sockets read from /proc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import json, os, sys
    from inferscale.store.arena import Arena
    from inferscale.store.nixl_transport import NixlTransport

    t = NixlTransport(Arena(1 << 20), ucx_port_range=sys.argv[1])
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN, one of ours
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    print(json.dumps({"ucx": t.has_ucx, "ports": sorted(set(ports))}))
    t.close()
""")


def test_ucx_listens_only_inside_the_configured_port_range():
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["PYTHONSAFEPATH"] = "1"
    out = subprocess.run([sys.executable, "-c", PROBE, "5561-5569"], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["ucx"]
    assert got["ports"], "UCX opened no TCP listener"
    assert all(5561 <= p <= 5569 for p in got["ports"]), got["ports"]
