"""The peer control port before authentication (inferscale/store/peer.py): a frame's announced length is
checked before anything is allocated, connections are capped, and a slow or idle client is cut off."""

from __future__ import annotations

import socket
import struct
import time
import tracemalloc

import pytest

from inferscale.store import peer as peerproto

SECRET = "peer-secret-for-tests"


@pytest.fixture
def server():
    srv = peerproto.PeerServer("127.0.0.1", 0, lambda msg: {"pong": True}, secret=SECRET,
                               max_connections=2, request_deadline_s=0.5)
    yield srv
    srv.close()


def _connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        while True:
            if not s.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_frame_announcing_16mb_before_auth_is_refused_without_allocating(server):
    tracemalloc.start()
    try:
        s = _connect(server)
        peerproto.recv_msg(s, peerproto.MAX_GREETING)  # the nonce
        s.sendall(struct.pack(">I", 16 << 20) + b"{")
        closed = _closed_within(s, 3.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    s.close()
    assert closed, "the server kept waiting for a 16 MB unauthenticated frame"
    assert peak < 4 << 20, f"{peak} bytes allocated for an unauthenticated frame"


def test_connections_over_the_cap_are_answered_busy(server):
    held = [_connect(server) for _ in range(2)]
    for s in held:
        peerproto.recv_msg(s, peerproto.MAX_GREETING)
    extra = _connect(server)
    assert peerproto.recv_msg(extra, peerproto.MAX_GREETING).get("error") == "busy"
    for s in held + [extra]:
        s.close()
    time.sleep(0.2)  # the slots come back: an authenticated request is served again
    assert peerproto.request(f"127.0.0.1:{server.port}", {"op": "ping"}, 5, SECRET) == {"pong": True}


def test_idle_and_trickling_clients_are_cut_off_at_the_deadline(server):
    idle = _connect(server)
    peerproto.recv_msg(idle, peerproto.MAX_GREETING)
    trickle = _connect(server)
    peerproto.recv_msg(trickle, peerproto.MAX_GREETING)
    trickle.sendall(struct.pack(">I", 100))
    t0 = time.monotonic()
    for _ in range(5):  # one byte every 0.2 s: each recv is quick, the whole request is not
        try:
            trickle.sendall(b" ")
        except OSError:
            break
        time.sleep(0.2)
    assert _closed_within(idle, 3.0) and _closed_within(trickle, 3.0)
    assert time.monotonic() - t0 < 3.0
    idle.close(), trickle.close()
