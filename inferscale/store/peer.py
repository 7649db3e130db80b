"""The tiny metadata service next to each node's NIXL agent (G4).

A puller asks over TCP "where are blocks X, Y of tenant/user?"; the owner makes them DRAM-resident, holds them
(a lease, so they cannot be evicted mid-transfer) and answers with arena addresses, sizes and checksums plus its
NIXL agent metadata. The puller then READs all of them in one NIXL request and says "done". Only metadata
crosses this socket; the bytes go through NIXL. Frames: 4-byte big-endian length + JSON.

Authentication (``INFERSCALE_PEER_SECRET``, never sent): on connect the server sends ``{"nonce": <hex>}``, fresh
per connection; the client's one request carries ``"auth": hex(HMAC-SHA256(secret, nonce || canonical JSON of
the request without "auth"))``, checked with ``hmac.compare_digest``. A sniffed request cannot be replayed (the
next connection has another nonce) nor altered (the MAC covers every field). The request also carries the
client's own nonce ``"cnonce"``; a successful reply carries ``"auth": hex(HMAC-SHA256(secret, "reply:" || cnonce ||
canonical JSON of the reply without "auth"))``, so a process on a peer's address without the secret cannot hand
out leases (forged blocks, metadata). Error replies are not MACed: forging one only fails a pull."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import socketserver
import struct
import threading
import time
from typing import Any, Callable

from inferscale.errors import TransferError

log = logging.getLogger(__name__)
# Frame bounds per direction, checked on the 4-byte length before a byte of the frame is allocated: a request
# (locate names at most a user's item ids) is read before its MAC can be checked, so it stays small.
MAX_GREETING = 1 << 10
MAX_REQUEST = 1 << 20
MAX_REPLY = 8 << 20  # locate: partial agent metadata (base64) + one record per block
MAX_CONNECTIONS = 32  # peer connections served at once; more are answered "busy" and closed
REQUEST_DEADLINE_S = 5.0  # from connect to a whole request: a slow or idle client is cut off


def send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes, read in pieces (nothing is allocated for bytes that never arrive); by ``deadline``
    (monotonic) when given, however slowly they trickle in."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("peer request deadline passed")
            sock.settimeout(left)
        piece = sock.recv(min(n - len(buf), 1 << 16))
        if not piece:
            raise ConnectionError("peer closed the connection")
        buf += piece
    return bytes(buf)


def recv_msg(sock: socket.socket, limit: int = MAX_REPLY, deadline: float | None = None) -> dict[str, Any]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if n > limit:
        raise ConnectionError(f"frame of {n} bytes announced, over the {limit}-byte limit")
    msg = json.loads(_recv_exact(sock, n, deadline))
    if not isinstance(msg, dict):
        raise ValueError("a frame that is not a JSON object")
    return msg


def canonical(msg: dict[str, Any]) -> bytes:
    """The bytes a request's MAC covers: every field but "auth", keys sorted, no whitespace."""
    return json.dumps({k: v for k, v in msg.items() if k != "auth"}, sort_keys=True, separators=(",", ":")).encode()


def request_mac(secret: str, nonce: str, msg: dict[str, Any]) -> str:
    return hmac.new(secret.encode(), nonce.encode() + b"\n" + canonical(msg), hashlib.sha256).hexdigest()


def reply_mac(secret: str, cnonce: str, reply: dict[str, Any]) -> str:
    return hmac.new(secret.encode(), b"reply:" + cnonce.encode() + b"\n" + canonical(reply),
                    hashlib.sha256).hexdigest()


def parse_peer(peer: str) -> tuple[str, int]:
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransferError(f"peer {peer!r} is not host:port")
    return host.strip("[]"), int(port)


def request(peer: str, msg: dict[str, Any], timeout_s: float, secret: str | None = None) -> dict[str, Any]:
    """One request/response to a peer's metadata service, bounded by ``timeout_s`` end to end; with ``secret``
    the request is MACed over the server's nonce (the secret itself never leaves this process)."""
    host, port = parse_peer(peer)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            nonce = recv_msg(s, MAX_GREETING).get("nonce")
            if not isinstance(nonce, str):
                raise ValueError("no nonce in the peer's greeting")
            if secret:
                msg = {**msg, "cnonce": secrets.token_hex(16)}
                msg["auth"] = request_mac(secret, nonce, msg)
            send_msg(s, msg)
            reply = recv_msg(s)
    except (OSError, ConnectionError, ValueError) as e:
        raise TransferError(f"peer {peer} unreachable or not answering ({e})") from None
    got = reply.pop("auth", None)
    if secret and "error" not in reply and not (isinstance(got, str) and hmac.compare_digest(
            got.encode(), reply_mac(secret, msg["cnonce"], reply).encode())):
        raise TransferError(f"peer {peer}: reply not authenticated (not a peer holding INFERSCALE_PEER_SECRET)")
    return reply


class PeerServer:
    """Serves ``handler(msg) -> reply`` on a TCP port in daemon threads; with ``secret``, only to MACed requests."""

    def __init__(self, host: str, port: int, handler: Callable[[dict[str, Any]], dict[str, Any]],
                 secret: str | None = None, timeout_s: float = 30.0, *, max_connections: int = MAX_CONNECTIONS,
                 request_deadline_s: float = REQUEST_DEADLINE_S) -> None:
        outer = self
        slots = threading.BoundedSemaphore(max_connections)

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:  # one request per connection
                self.request.settimeout(timeout_s)
                try:
                    nonce = secrets.token_hex(16)
                    send_msg(self.request, {"nonce": nonce})
                    msg = recv_msg(self.request, MAX_REQUEST, time.monotonic() + request_deadline_s)
                    self.request.settimeout(timeout_s)
                    got = msg.get("auth")
                    if secret is not None and not (isinstance(got, str) and hmac.compare_digest(
                            got.encode(), request_mac(secret, nonce, msg).encode())):
                        reply = {"error": "unauthorized", "message": "bad or missing peer MAC (INFERSCALE_PEER_SECRET)"}
                    else:
                        reply = outer._safe(handler, msg)
                        cnonce = msg.get("cnonce")
                        if secret is not None and "error" not in reply and isinstance(cnonce, str):
                            reply = {**reply, "auth": reply_mac(secret, cnonce, reply)}
                    send_msg(self.request, reply)
                except (OSError, ConnectionError, ValueError) as e:
                    log.debug("peer connection dropped: %s", e)

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request, client_address) -> None:
                if not slots.acquire(blocking=False):  # no thread for a connection over the cap
                    try:
                        request.settimeout(1.0)
                        send_msg(request, {"error": "busy", "message": "too many peer connections"})
                    except OSError:
                        pass
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    slots.release()
                    raise

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        self._server = _Server((host, port), _Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvstore-peer", daemon=True)
        self._thread.start()

    @staticmethod
    def _safe(handler: Callable[[dict[str, Any]], dict[str, Any]], msg: dict[str, Any]) -> dict[str, Any]:
        from inferscale.errors import InferScaleError, NotFoundError

        try:
            return handler(msg)
        except NotFoundError as e:
            return {"error": "not_found", "message": str(e)}
        except InferScaleError as e:
            return {"error": type(e).__name__, "message": str(e)}
        except Exception as e:  # noqa: BLE001 - a bug here must not kill the service thread
            log.exception("peer request failed")
            return {"error": "internal", "message": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
