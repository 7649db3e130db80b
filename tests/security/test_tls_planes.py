"""TLS on the internal plane (operator -> server) and the peer control channel (server <-> server): what a network
attacker between the pods sees and what a party without the fleet's certificate gets (inferscale/fleettls.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from inferscale.errors import ConfigError, TransferError
from inferscale.fleettls import FleetTls
from inferscale.operator.servers import ServerCallError, ServerClient, ServingPod
from inferscale.operator.settings import Settings as OperatorSettings
from inferscale.server.cli import internal_tls_options
from inferscale.store import peer as peerproto
from inferscale.store import peer_protocol as wire

from fleet_certs import SERVER_NAME, make_fleet_tls
from security.relay import Listener, Relay

INTERNAL_TOKEN = "internal-secret"  # the live server's (tests/server/conftest.py)
PEER_SECRET = "peer-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> FleetTls:
    return make_fleet_tls(tmp_path_factory.mktemp("fleet-tls"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory) -> FleetTls:
    """Certificates of the same name from a CA the fleet does not trust."""
    return make_fleet_tls(tmp_path_factory.mktemp("stranger-tls"))


@pytest.fixture(scope="module")
def tls_internal(live, fleet):
    """The live server's internal app on a listener of its own, served as `inferscale serve` serves it with TLS."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(live.app.state.internal_app, log_level="warning", lifespan="off",
                                           **internal_tls_options(fleet)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "TLS internal listener did not start"
        time.sleep(0.05)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def _operator(ca: FleetTls | None, name: str = SERVER_NAME) -> OperatorSettings:
    tls = {} if ca is None else {"tls_ca_file": str(ca.ca_file), "tls_server_name": name}
    return OperatorSettings(internal_token=INTERNAL_TOKEN, http_timeout_seconds=10, **tls)


def _capacity(settings: OperatorSettings, endpoint: str) -> dict:
    async def call() -> dict:
        async with ServerClient(settings) as client:
            return await client.capacity(ServingPod("server-0", "inferscale", "node-a", endpoint, None))
    return asyncio.run(call())


# -- the internal plane ---------------------------------------------------------------------------------------
def test_operator_calls_the_internal_api_over_tls(tls_internal, fleet):
    reply = _capacity(_operator(fleet), f"https://127.0.0.1:{tls_internal}")
    assert isinstance(reply, dict) and reply


def test_internal_api_refuses_plain_http_when_tls_is_on(tls_internal):
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{tls_internal}/internal/v1/capacity",
                  headers={"Authorization": f"Bearer {INTERNAL_TOKEN}"}, timeout=5)


def test_operator_refuses_a_server_certificate_the_ca_did_not_sign(tls_internal, stranger):
    with pytest.raises(ServerCallError, match="CERTIFICATE_VERIFY_FAILED"):
        _capacity(_operator(stranger), f"https://127.0.0.1:{tls_internal}")


def test_operator_refuses_a_server_certificate_of_another_name(tls_internal, fleet):
    with pytest.raises(ServerCallError, match="CERTIFICATE_VERIFY_FAILED"):
        _capacity(_operator(fleet, name="inferscale-headless.other-namespace.svc"),
                  f"https://127.0.0.1:{tls_internal}")


def test_operator_with_tls_sends_nothing_to_a_plain_http_endpoint(fleet):
    """An annotation or a stale pod that names http:// gets no request, so the token never travels in clear."""
    seen = bytearray()
    trap = Listener(lambda conn: seen.extend(conn.recv(65536)))
    try:
        with pytest.raises(ServerCallError, match="not https"):
            _capacity(_operator(fleet), f"http://{trap.address}")
        time.sleep(0.2)
        assert not seen
    finally:
        trap.close()


def test_bearer_token_is_not_on_the_wire_with_tls(live, tls_internal, fleet):
    """A proxy between the operator and the server records every byte: with TLS neither the token nor the route
    appears; without TLS (how the plane was before) both do, which is what this test would have caught."""
    plain_port = int(live.internal_url.rsplit(":", 1)[1])
    clear = Relay(("127.0.0.1", plain_port))
    sealed = Relay(("127.0.0.1", tls_internal))
    try:
        _capacity(_operator(None), f"http://{clear.address}")
        _capacity(_operator(fleet), f"https://{sealed.address}")
        time.sleep(0.2)
        assert INTERNAL_TOKEN.encode() in clear.sent and b"/internal/v1/capacity" in clear.sent
        assert sealed.sent and sealed.received
        for wire_bytes in (sealed.sent, sealed.received):
            assert INTERNAL_TOKEN.encode() not in wire_bytes and b"/internal/v1" not in wire_bytes
    finally:
        clear.close()
        sealed.close()


# -- the peer control channel ---------------------------------------------------------------------------------
@pytest.fixture
def tls_peer(fleet):
    calls: list[dict] = []

    def handler(msg, session):
        calls.append(msg)
        return {"pong": True}

    server = peerproto.PeerServer("127.0.0.1", 0, handler, PEER_SECRET, timeout_s=5.0, tls=fleet)
    yield f"127.0.0.1:{server.port}", calls
    server.close()


def test_peer_session_over_tls(tls_peer, fleet):
    address, calls = tls_peer
    with peerproto.PeerSession(address, PEER_SECRET, 5.0, fleet) as session:
        assert session.call({"op": "ping", "tenant": "acme"}) == {"pong": True}
        assert session.sock.version() == "TLSv1.3"
        # Nagle off: the handshake's small writes otherwise wait for a delayed ACK (~40 ms per new session here)
        assert session.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert calls == [{"op": "ping", "tenant": "acme"}]


def test_peer_frames_are_not_on_the_wire_with_tls(tls_peer, fleet):
    """A relay between two peers sees the greeting, the hello and a request cross, all encrypted (and the session
    fails anyway: the MACs bind the TCP endpoints, which a relay cannot keep). Without TLS the same relay reads
    every frame, which is what this would have caught."""
    address, calls = tls_peer
    relay = Relay(peerproto.parse_peer(address))
    plain_server = peerproto.PeerServer("127.0.0.1", 0, lambda m, _s: {"ok": True}, PEER_SECRET, timeout_s=5.0)
    clear = Relay(("127.0.0.1", plain_server.port))
    try:
        with pytest.raises(TransferError, match="not authenticated"):
            peerproto.request(clear.address, {"op": "ping", "tenant": "acme"}, 5.0, PEER_SECRET)
        time.sleep(0.2)
        assert b"nonce" in clear.received and b"proof" in clear.sent  # the frames, readable without TLS
        with pytest.raises(TransferError, match="not authenticated"):
            peerproto.request(relay.address, {"op": "ping", "tenant": "acme"}, 5.0, PEER_SECRET, fleet)
        time.sleep(0.2)
        assert len(relay.sent) > 200 and len(relay.received) > 200  # handshake, hello, request; greeting, refusal
        for wire_bytes in (relay.sent, relay.received):
            for plain in (b"nonce", b"proof", b"ping", b"acme", b"auth", b"unauthorized"):
                assert plain not in wire_bytes
        assert calls == []
    finally:
        relay.close()
        clear.close()
        plain_server.close()


def test_peer_without_tls_gets_no_greeting(tls_peer):
    """A plain-TCP client (today's protocol, no TLS) is dropped before the greeting: no nonce, no MAC exchange."""
    address, calls = tls_peer
    host, port = peerproto.parse_peer(address)
    with socket.create_connection((host, port), timeout=3) as s:
        wire.send_msg(s, {"cnonce": "00" * 16, "proof": "0" * 64})
        got = bytearray()
        try:
            while piece := s.recv(4096):
                got += piece
        except OSError:
            pass
    assert b"nonce" not in got and b"v" not in got[:8]
    with pytest.raises(TransferError):
        peerproto.request(address, {"op": "ping"}, 3.0, PEER_SECRET)  # the client without TLS
    assert calls == []


def test_peer_refuses_a_server_the_fleet_ca_did_not_sign(tls_peer, stranger):
    address, calls = tls_peer
    with pytest.raises(TransferError, match="TLS certificate refused"):
        peerproto.request(address, {"op": "ping"}, 3.0, PEER_SECRET, stranger)
    assert calls == []


def test_peer_refuses_a_client_certificate_the_fleet_ca_did_not_sign(tls_peer, fleet, stranger):
    """The client trusts the fleet's CA but presents a stranger's certificate: the server ends the handshake, so
    not even the greeting (the nonce a MAC would bind) is sent."""
    address, calls = tls_peer
    intruder = FleetTls(fleet.ca_file, SERVER_NAME, stranger.cert_file, stranger.key_file)
    with pytest.raises(TransferError):
        peerproto.request(address, {"op": "ping"}, 3.0, PEER_SECRET, intruder)
    assert calls == []


def test_peer_refuses_a_server_certificate_of_another_name(tls_peer, fleet):
    address, calls = tls_peer
    other = FleetTls(fleet.ca_file, "inferscale-headless.other-namespace.svc", fleet.cert_file, fleet.key_file)
    with pytest.raises(TransferError, match="TLS certificate refused"):
        peerproto.request(address, {"op": "ping"}, 3.0, PEER_SECRET, other)
    assert calls == []


# -- settings -------------------------------------------------------------------------------------------------
def test_server_refuses_a_tls_key_others_can_read(tmp_path, fleet):
    from inferscale.server.settings import Settings

    key = tmp_path / "tls.key"
    key.write_bytes(fleet.key_file.read_bytes())
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="INFERSCALE_TLS_KEY_FILE .* is mode 0644"):
        Settings(data_dir=tmp_path, tls_cert_file=fleet.cert_file, tls_key_file=key, tls_ca_file=fleet.ca_file,
                 tls_server_name=SERVER_NAME)


def test_tls_settings_come_together_or_not_at_all(tmp_path, fleet):
    from inferscale.server.settings import Settings

    with pytest.raises(ConfigError, match="missing: INFERSCALE_TLS_SERVER_NAME, INFERSCALE_TLS_KEY_FILE"):
        Settings(data_dir=tmp_path, tls_cert_file=fleet.cert_file, tls_ca_file=fleet.ca_file)
    with pytest.raises(ConfigError, match="missing: INFERSCALE_TLS_SERVER_NAME"):
        OperatorSettings.from_env({"INFERSCALE_TLS_CA_FILE": str(fleet.ca_file)})
    bad = tmp_path / "ca.crt"
    bad.write_text("not a certificate")
    with pytest.raises(ConfigError, match="cannot load"):
        OperatorSettings.from_env({"INFERSCALE_TLS_CA_FILE": str(bad), "INFERSCALE_TLS_SERVER_NAME": SERVER_NAME})
    assert Settings(data_dir=tmp_path).fleet_tls is None


def test_a_rotated_certificate_is_served_from_the_next_handshake(tmp_path):
    """A re-rendered chart writes a new certificate into the mounted Secret: the next connection gets it, with no
    restart; a client that trusts only the new CA then connects."""
    import shutil

    from fleet_certs import make_fleet_tls as make

    old, new = make(tmp_path / "old"), make(tmp_path / "new")
    live_dir = tmp_path / "mounted"
    shutil.copytree(tmp_path / "old", live_dir)
    mounted = FleetTls(live_dir / "ca.crt", SERVER_NAME, live_dir / "fleet.crt", live_dir / "fleet.key")
    server = peerproto.PeerServer("127.0.0.1", 0, lambda m, s: {"ok": True}, PEER_SECRET, 5.0, tls=mounted)
    try:
        address = f"127.0.0.1:{server.port}"
        assert peerproto.request(address, {"op": "ping"}, 3.0, PEER_SECRET, old) == {"ok": True}
        time.sleep(0.01)  # a new mtime
        for name in ("ca.crt", "fleet.crt", "fleet.key"):
            shutil.copy2(new.ca_file.parent / name, live_dir / name)
            (live_dir / name).touch()
        assert peerproto.request(address, {"op": "ping"}, 3.0, PEER_SECRET, new) == {"ok": True}
        with pytest.raises(TransferError):
            peerproto.request(address, {"op": "ping"}, 3.0, PEER_SECRET, old)
    finally:
        server.close()
