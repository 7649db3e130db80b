"""Attacks on the internal plane (operator -> server) and the peer plane's control port (server -> server)."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from inferscale.errors import ConfigError, TransferError
from inferscale.server.auth import TenantRegistry, hash_key
from inferscale.store import peer as peerproto

from server_live_fixtures import KEYS

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

    shared = "isk-same-secret"
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


class Recorder:
    """A TCP relay in front of a peer port that keeps every byte the client sent."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.sent = target, bytearray()
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.srv.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def test_peer_secret_never_travels_and_a_sniffed_request_cannot_be_replayed():
    secret = "peer-secret-0123456789abcdef"
    seen = []
    server = peerproto.PeerServer("127.0.0.1", 0, lambda m: seen.append(m) or {"ok": True}, secret=secret,
                                  timeout_s=5)
    try:
        rec = Recorder(("127.0.0.1", server.port))
        msg = {"op": "locate", "tenant": "acme", "user": "alice", "items": None, "fingerprint": None, "dir": None}
        assert peerproto.request(rec.address, msg, 5, secret) == {"ok": True}
        assert len(seen) == 1 and bytes(rec.sent)
        assert secret.encode() not in bytes(rec.sent)
        # Replaying the exact request on a new connection fails: the server's nonce differs.
        captured = bytes(rec.sent)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            peerproto.recv_msg(s)  # the new nonce
            s.sendall(captured)
            assert peerproto.recv_msg(s)["error"] == "unauthorized"
        # No secret, or the wrong one: refused, and the handler never runs.
        for wrong in (None, "not-the-secret"):
            assert peerproto.request(f"127.0.0.1:{server.port}", msg, 5, wrong)["error"] == "unauthorized"
        assert len(seen) == 1
    finally:
        server.close()


def test_a_process_without_the_secret_cannot_answer_as_a_peer():
    """Whoever listens on a peer's address without the secret (a pod that set its own nixl-peer annotation, a
    spoofed address) cannot hand the puller a lease: its reply carries no valid MAC."""
    forged = {"lease": "x", "node": "evil", "agent": "", "blocks": [{"item": "m1", "fingerprint": "f" * 64,
                                                                     "addr": 0, "size": 8, "sha256": "0" * 64}]}
    impostor = peerproto.PeerServer("127.0.0.1", 0, lambda m: dict(forged), secret=None, timeout_s=5)
    wrong = peerproto.PeerServer("127.0.0.1", 0, lambda m: dict(forged), secret="another-secret", timeout_s=5)
    try:
        msg = {"op": "locate", "tenant": "acme", "user": "alice", "items": None, "fingerprint": None, "dir": None}
        with pytest.raises(TransferError, match="not authenticated"):
            peerproto.request(f"127.0.0.1:{impostor.port}", msg, 5, "the-real-secret")
        assert peerproto.request(f"127.0.0.1:{wrong.port}", msg, 5, "the-real-secret")["error"] == "unauthorized"
    finally:
        impostor.close()
        wrong.close()
