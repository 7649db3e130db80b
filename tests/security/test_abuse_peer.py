"""The peer control port before authentication (inferscale/store/peer.py): a frame's announced length and nesting
are checked before anything is allocated or parsed, unauthenticated connections are bounded per source and cut
off at a short deadline, and sessions are capped."""

from __future__ import annotations

import socket
import struct
import time
import tracemalloc

import pytest

from inferscale.store import peer as peerproto
from inferscale.store import peer_protocol as wire

SECRET = "peer-secret-for-tests"
ATTACKER_SOURCE = "127.0.0.2"  # loopback is 127/8: another source address than the legitimate client's


@pytest.fixture
def server():
    srv = peerproto.PeerServer("127.0.0.1", 0, lambda msg, _s: {"pong": True}, SECRET,
                               preauth_per_source=2, preauth_deadline_s=0.5, max_sessions=2, sessions_per_peer=2)
    yield srv
    srv.close()


def _connect(srv, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=5, source_address=(source, 0))


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


def _ping(srv) -> dict:
    return peerproto.request(f"127.0.0.1:{srv.port}", {"op": "ping"}, 5, SECRET)


def test_frame_announcing_16mb_before_auth_is_refused_without_allocating(server):
    tracemalloc.start()
    try:
        s = _connect(server)
        wire.recv_msg(s, wire.MAX_GREETING)  # the nonce
        s.sendall(struct.pack(">I", 16 << 20) + b"{")
        closed = _closed_within(s, 3.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    s.close()
    assert closed, "the server kept waiting for a 16 MB unauthenticated frame"
    assert peak < 4 << 20, f"{peak} bytes allocated for an unauthenticated frame"


def test_deeply_nested_json_before_auth_is_refused_before_parsing(server, capfd):
    """Before: ``json.loads`` of 1000 nested arrays raised RecursionError in the connection's thread."""
    with pytest.raises(wire.FrameError, match="deeper"):
        wire.parse_bounded(b"[" * 1000 + b"]" * 1000)
    s = _connect(server)
    wire.recv_msg(s, wire.MAX_GREETING)
    body = b"[" * 1000 + b"]" * 1000
    s.sendall(struct.pack(">I", len(body)) + body)
    assert _closed_within(s, 3.0)
    s.close()
    assert "RecursionError" not in capfd.readouterr().err
    assert _ping(server) == {"pong": True}
    assert wire.parse_bounded(b'{"a": "[[[[[[[[[[[[[[[[[[[[", "b": [[1]]}') == {"a": "[" * 20, "b": [[1]]}


def test_unauthenticated_connections_are_bounded_per_source(server):
    held = [_connect(server, ATTACKER_SOURCE) for _ in range(2)]
    for s in held:
        wire.recv_msg(s, wire.MAX_GREETING)
    extra = _connect(server, ATTACKER_SOURCE)
    assert wire.recv_msg(extra, wire.MAX_GREETING).get("error") == "busy"
    assert _ping(server) == {"pong": True}  # another source is still served meanwhile
    for s in held + [extra]:
        s.close()


def test_32_idle_connections_do_not_starve_a_legitimate_peer():
    """Before: 32 idle TCP connections, no authentication needed, held every peer slot for 5 s each."""
    srv = peerproto.PeerServer("127.0.0.1", 0, lambda msg, _s: {"pong": True}, SECRET)
    idle = []
    try:
        for _ in range(32):
            idle.append(_connect(srv, ATTACKER_SOURCE))
        t0 = time.monotonic()
        assert _ping(srv) == {"pong": True}
        assert time.monotonic() - t0 < 2.0
    finally:
        for s in idle:
            s.close()
        srv.close()


def test_idle_and_trickling_clients_are_cut_off_at_the_deadline(server):
    idle = _connect(server)
    wire.recv_msg(idle, wire.MAX_GREETING)
    trickle = _connect(server)
    wire.recv_msg(trickle, wire.MAX_GREETING)
    trickle.sendall(struct.pack(">I", 100))
    t0 = time.monotonic()
    for _ in range(5):  # one byte every 0.2 s: each recv is quick, the whole hello is not
        try:
            trickle.sendall(b" ")
        except OSError:
            break
        time.sleep(0.2)
    assert _closed_within(idle, 3.0) and _closed_within(trickle, 3.0)
    assert time.monotonic() - t0 < 3.0
    idle.close(), trickle.close()


def test_authenticated_sessions_are_capped_and_come_back(server):
    sessions = [peerproto.PeerSession(f"127.0.0.1:{server.port}", SECRET, 5) for _ in range(2)]
    try:
        for s in sessions:
            assert s.call({"op": "ping"}) == {"pong": True}
        refused = _ping(server)  # a refused hello is answered, MACed: the client can tell "busy" from a forgery
        assert refused["error"] == "busy" and refused["hello"] is False
    finally:
        for s in sessions:
            s.close()
    time.sleep(0.2)
    assert _ping(server) == {"pong": True}



def test_a_request_is_authenticated_before_any_of_it_is_parsed(server, monkeypatch):
    """Requests are signed frames: the MAC covers the bytes before the frame's last field, so the server checks it
    first and parses nothing a holder of the secret did not send (before: every request was parsed, then its
    canonical form re-serialized to check the MAC)."""
    with peerproto.PeerSession(f"127.0.0.1:{server.port}", SECRET, 5) as s:
        assert s.call({"op": "ping"}) == {"pong": True}
        parsed: list[bytes] = []
        real = wire.parse_bounded
        monkeypatch.setattr(wire, "parse_bounded", lambda data, *a: parsed.append(data) or real(data, *a))
        wire.send_frame(s.sock, b'{"n":' + b"[" * 100 + b"]" * 100 + b',"auth":"' + b"0" * 64 + b'"}')
        body, _ = wire.unsigned(wire.recv_frame(s.sock))
        assert b'"unauthorized"' in body and parsed == []  # refused, and nothing of the request was parsed
    assert _ping(server) == {"pong": True}
