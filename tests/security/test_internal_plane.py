"""Attacks on the internal plane (operator -> server) and the peer plane's control port (server -> server)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from inferscale.errors import ConfigError, TransferError
from inferscale.server.auth import TenantRegistry, hash_key
from inferscale.store import peer as peerproto
from inferscale.store import peer_protocol as wire

from server_live_fixtures import KEYS
from security.relay import Relay

INTERNAL_TOKEN = "internal-secret"  # the live server's (tests/server/conftest.py)

INTERNAL_PATHS = [("GET", "/internal/v1/capacity", None),
                  ("POST", "/internal/v1/purge", {"tenant": "acme", "user": "caroline", "items": None}),
                  ("POST", "/internal/v1/pull", {"tenant": "acme", "user": "caroline", "items": None,
                                                 "source": {"node": "node-a", "dir": "/x/acme/caroline",
                                                            "peer": None}})]


@pytest.mark.parametrize("method,path,body", INTERNAL_PATHS)
def test_internal_routes_do_not_exist_on_the_tenant_port(live, method, path, body):
    """Even the right internal token gets a 404 on the tenant listener: the routes are not mounted there."""
    for token in (INTERNAL_TOKEN, KEYS["acme"]):
        r = httpx.request(method, live.url + path, json=body, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 404, (path, r.status_code, r.text)


@pytest.mark.parametrize("method,path,body", INTERNAL_PATHS)
def test_tenant_key_refused_on_the_internal_port(live, method, path, body):
    for headers in ({}, {"Authorization": f"Bearer {KEYS['acme']}"}, {"Authorization": "Bearer internal-secreT"}):
        r = httpx.request(method, live.internal_url + path, json=body, headers=headers)
        assert r.status_code == 401, (path, headers, r.text)
    ok = httpx.get(live.internal_url + "/internal/v1/capacity", headers={"Authorization": f"Bearer {INTERNAL_TOKEN}"})
    assert ok.status_code == 200


def test_internal_port_serves_nothing_but_internal(live):
    """The tenant API is not reachable through the internal listener either."""
    r = httpx.get(live.internal_url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['acme']}"})
    assert r.status_code == 404


@pytest.mark.parametrize("field", ["internal_token", "peer_secret"])
def test_server_refuses_a_tenant_key_equal_to_a_plane_credential(tmp_path, tiny_engine, embedder, field):
    """A tenant who knows their own key must never hold the internal token or the peer secret."""
    from inferscale.server.app import create_app
    from inferscale.server.settings import Settings
    from inferscale.store import KVStore

    shared = "isk-same-secret-0123456789"
    tenants_file = tmp_path / "tenants.json"
    tenants_file.write_text(json.dumps({"acme": [hash_key(shared)]}))
    settings = Settings(data_dir=tmp_path, tenants_file=tenants_file, **{field: shared})
    with KVStore(tmp_path / "store", dram_budget_bytes=16 << 20, nixl=False) as store:
        with pytest.raises(ConfigError, match="equals INFERSCALE_"):
            create_app(settings, engine=tiny_engine, embedder=embedder, store=store)


def test_tenants_file_loader_refuses_a_plane_credential_on_reload(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"acme": [hash_key("isk-a")]}))
    reg = TenantRegistry(path, max_k=1, max_tokens=1, max_in_flight=1)
    reg.forbid({"INFERSCALE_INTERNAL_TOKEN": "tok-internal", "INFERSCALE_PEER_SECRET": "tok-peer"})
    path.write_text(json.dumps({"acme": [hash_key("isk-a")], "evil": [hash_key("tok-peer")]}))
    with pytest.raises(ConfigError, match="INFERSCALE_PEER_SECRET"):
        reg.reload()
    with pytest.raises(Exception):
        reg.authenticate("tok-peer")  # the last good file stays in force


def test_peer_secret_never_travels_and_a_relayed_or_replayed_session_is_refused():
    secret = "peer-secret-0123456789abcdef"
    seen = []
    server = peerproto.PeerServer("127.0.0.1", 0, lambda m, _s: seen.append(m) or {"ok": True}, secret,
                                  timeout_s=5)
    rec = Relay(("127.0.0.1", server.port))
    try:
        msg = {"op": "locate", "tenant": "acme", "user": "alice", "items": None, "fingerprint": None, "dir": None}
        assert peerproto.request(f"127.0.0.1:{server.port}", msg, 5, secret) == {"ok": True}
        # Through a relay (another TCP connection in between), the same client and secret get nowhere: the
        # session is bound to the endpoints each side sees, so nothing relayed verifies.
        with pytest.raises(TransferError, match="not authenticated"):
            peerproto.request(rec.address, msg, 5, secret)
        assert len(seen) == 1 and bytes(rec.sent)
        assert secret.encode() not in bytes(rec.sent)
        # Replaying the sniffed bytes on a new connection fails: the server's nonce and the endpoints differ.
        captured = bytes(rec.sent)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            wire.recv_msg(s)  # the new nonce
            s.sendall(captured)
            assert wire.recv_msg(s)["error"] == "unauthorized"
        # The wrong secret: refused, and the handler never runs.
        with pytest.raises(TransferError, match="not authenticated"):
            peerproto.request(f"127.0.0.1:{server.port}", msg, 5, "not-the-secret-0123456789")
        assert len(seen) == 1
    finally:
        rec.close()
        server.close()


def test_a_process_without_the_secret_cannot_answer_as_a_peer():
    """Whoever listens on a peer's address without the secret (a pod that set its own nixl-peer annotation, a
    spoofed address) cannot hand the puller a lease, nor a "not found": its replies carry no valid MAC."""
    forged = {"lease": "x", "node": "evil", "blocks": [{"item": "m1", "fingerprint": "f" * 64, "size": 8,
                                                          "sha256": "0" * 64}]}
    wrong = peerproto.PeerServer("127.0.0.1", 0, lambda m, _s: dict(forged), "another-secret-0123456789",
                                 timeout_s=5)
    try:
        msg = {"op": "locate", "tenant": "acme", "user": "alice", "items": None, "fingerprint": None, "dir": None}
        with pytest.raises(TransferError, match="not authenticated"):
            peerproto.request(f"127.0.0.1:{wrong.port}", msg, 5, "the-real-secret-0123456789")
    finally:
        wrong.close()
