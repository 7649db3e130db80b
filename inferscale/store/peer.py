"""The peer control plane's transport (G4): authenticated sessions over TCP (messages and MACs:
inferscale/store/peer_protocol.py).

Only metadata crosses these sockets; block bytes go through NIXL. Admission is in two stages so that nobody
without the secret can starve the peers that have it: a connection that has not yet proved the secret holds a
pre-auth slot, at most ``preauth_per_source`` per source address and ``preauth_total`` in all, for at most
``preauth_deadline_s``; a proved session then holds one of ``max_sessions`` session slots (``sessions_per_peer``
per source).

With a FleetTls (inferscale/fleettls.py) both ends speak TLS 1.3 and verify each other against the fleet CA
before any frame: the handshake happens inside the pre-auth slot and its deadline, and a connection that is not
TLS, or whose certificate the CA did not sign, is dropped before the greeting. The MACs stay the authorization."""

from __future__ import annotations

import logging
import secrets
import select
import socket
import socketserver
import ssl
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from inferscale.errors import InferScaleError, NotFoundError, TransferError
from inferscale.store import peer_protocol as wire

if TYPE_CHECKING:
    from inferscale.fleettls import FleetTls

log = logging.getLogger(__name__)
PREAUTH_PER_SOURCE = 4
PREAUTH_TOTAL = 64
PREAUTH_DEADLINE_S = 1.0  # from connect to a verified hello
MAX_SESSIONS = 32
SESSIONS_PER_PEER = 16  # one pod's concurrent pulls from this one; the rest of MAX_SESSIONS stays for others
MAX_REQUESTS_PER_SESSION = 64


@dataclass(frozen=True)
class Session:
    """One authenticated connection, as the server sees it."""

    id: str
    peer: str  # the client's source address: what per-peer caps count
    transcript: bytes


Handler = Callable[[dict[str, Any], Session], dict[str, Any]]


def parse_peer(peer: str) -> tuple[str, int]:
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransferError(f"peer {peer!r} is not host:port")
    return host.strip("[]"), int(port)


class PeerSession:
    """The client side of one session: connect, prove the secret, then ``call`` any number of requests, each reply
    checked against the transcript. Raises TransferError on anything a peer holding the secret would not send."""

    def __init__(self, peer: str, secret: str, timeout_s: float, tls: FleetTls | None = None) -> None:
        self.peer, self.secret, self.timeout_s = peer, wire.check_secret(secret), timeout_s
        host, port = parse_peer(peer)
        self.seq = 0
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as e:
            raise TransferError(f"peer {peer} unreachable ({e})") from None
        if tls is not None:
            self.sock = _client_tls(self.sock, peer, tls)
        try:
            self.sock.settimeout(timeout_s)
            greeting = wire.recv_msg(self.sock, wire.MAX_GREETING)
            snonce = greeting.get("nonce")
            if greeting.get("v") != 2 or not isinstance(snonce, str):
                raise TransferError(f"peer {peer}: no peer-protocol greeting ({greeting.get('error', 'no nonce')})")
            cnonce = secrets.token_hex(16)
            self.t = wire.transcript(snonce, cnonce, wire.endpoint(self.sock.getpeername()),
                                     wire.endpoint(self.sock.getsockname()))
            self.hello = {"cnonce": cnonce, "proof": wire.client_proof(secret, self.t)}
            wire.send_msg(self.sock, self.hello)
        except (OSError, ValueError) as e:
            self.sock.close()
            raise TransferError(f"peer {peer} not answering ({e})") from None
        except BaseException:
            self.sock.close()
            raise
        self.hello_checked = False

    def _authentic(self, request_body: bytes, frame: bytes) -> dict[str, Any]:
        """The reply in ``frame`` once its MAC checks: over the request's body, or over the hello when the server
        refused that (its reply then says ``hello``)."""
        body, auth = wire.unsigned(frame)
        reply = wire.parse_bounded(body) if body else {}
        if reply.get("hello") is not None:  # the server refused the hello: its reply answers that
            request_body = wire.canonical(self.hello)
        if not body or not wire.verify(auth, wire.reply_mac(self.secret, self.t, request_body, body)):
            raise TransferError(f"peer {self.peer}: reply not authenticated (not a peer holding "
                                "INFERSCALE_PEER_SECRET)")
        return {k: v for k, v in reply.items() if k != "seq"}

    def call(self, msg: dict[str, Any], progress: Callable[[], object] | None = None) -> dict[str, Any]:
        """One request; its reply (an ``error`` reply included) once its MAC checks. ``progress`` runs while the
        reply is awaited (a NIXL agent that must progress for the peer's transfer to land)."""
        self.seq += 1
        body, frame = wire.signed({**msg, "seq": self.seq}, lambda b: wire.request_mac(self.secret, self.t, b))
        try:
            wire.send_frame(self.sock, frame)
            if progress is not None:
                deadline = time.monotonic() + self.timeout_s
                while not _readable(self.sock):
                    if time.monotonic() > deadline:
                        raise TimeoutError("no reply in time")
                    progress()
            return self._authentic(body, wire.recv_frame(self.sock))
        except (OSError, ValueError) as e:
            raise TransferError(f"peer {self.peer} not answering ({e})") from None

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> PeerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def request(peer: str, msg: dict[str, Any], timeout_s: float, secret: str,
            tls: FleetTls | None = None) -> dict[str, Any]:
    """One request in a session of its own."""
    with PeerSession(peer, secret, timeout_s, tls) as s:
        return s.call(msg)


def _client_tls(sock: socket.socket, peer: str, tls: FleetTls) -> ssl.SSLSocket:
    """``sock`` after a TLS handshake that proved the peer holds the fleet certificate (and presented ours)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the handshake's small writes, not Nagle's 40 ms
        return tls.client_context().wrap_socket(sock, server_hostname=tls.server_name)
    except ssl.SSLCertVerificationError as e:
        sock.close()
        raise TransferError(f"peer {peer}: TLS certificate refused ({e.verify_message}; "
                            f"expected {tls.server_name!r} signed by INFERSCALE_TLS_CA_FILE)") from None
    except OSError as e:  # ssl.SSLError included: not TLS, or our certificate refused
        sock.close()
        raise TransferError(f"peer {peer}: TLS handshake failed ({e})") from None


def session_closed(session: PeerSession) -> bool:
    """Whether the peer closed an idle session (its EOF, or anything it sent unasked, is waiting): checked before
    a request that must not be sent twice."""
    return bool(select.select([session.sock], [], [], 0)[0])


def _readable(sock: socket.socket) -> bool:
    """A reply has begun: bytes TLS already decrypted, or bytes on the socket."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    return bool(select.select([sock], [], [], 0.0002)[0])


class _Admission:
    """Counts of pre-auth connections and sessions, per source and in all."""

    def __init__(self, preauth_per_source: int, preauth_total: int, max_sessions: int, per_peer: int) -> None:
        self.lock = threading.Lock()
        self.preauth: Counter[str] = Counter()
        self.sessions: Counter[str] = Counter()
        self.limits = (preauth_per_source, preauth_total, max_sessions, per_peer)

    def enter(self, source: str) -> bool:
        per_source, total = self.limits[:2]
        with self.lock:
            if self.preauth[source] >= per_source or sum(self.preauth.values()) >= total:
                return False
            self.preauth[source] += 1
            return True

    def promote(self, source: str) -> bool:
        """Pre-auth -> session; False (and still pre-auth) when the session slots are full."""
        most, per_peer = self.limits[2:]
        with self.lock:
            if self.sessions[source] >= per_peer or sum(self.sessions.values()) >= most:
                return False
            self.sessions[source] += 1
            self._drop(self.preauth, source)
            return True

    def leave(self, source: str, promoted: bool) -> None:
        with self.lock:
            self._drop(self.sessions if promoted else self.preauth, source)

    @staticmethod
    def _drop(c: Counter[str], source: str) -> None:
        c[source] -= 1
        if c[source] <= 0:
            del c[source]


def _safe(handler: Handler, msg: dict[str, Any], session: Session) -> dict[str, Any]:
    try:
        return handler(msg, session)
    except NotFoundError as e:
        return {"error": "not_found", "message": str(e)}
    except InferScaleError as e:
        return {"error": type(e).__name__, "message": str(e)}
    except Exception as e:  # noqa: BLE001 - a bug here must not kill the service thread
        log.exception("peer request failed")
        return {"error": "internal", "message": f"{type(e).__name__}: {e}"}


class PeerServer:
    """Serves ``handler(msg, session) -> reply`` to sessions that proved ``secret``; ``on_close(session)`` runs when
    a session ends (however it ends)."""

    def __init__(self, host: str, port: int, handler: Handler, secret: str, timeout_s: float = 30.0, *,
                 on_close: Callable[[Session], None] | None = None, preauth_per_source: int = PREAUTH_PER_SOURCE,
                 preauth_total: int = PREAUTH_TOTAL, preauth_deadline_s: float = PREAUTH_DEADLINE_S,
                 max_sessions: int = MAX_SESSIONS, sessions_per_peer: int = SESSIONS_PER_PEER,
                 tls: FleetTls | None = None) -> None:
        secret = wire.check_secret(secret)
        admission = _Admission(preauth_per_source, preauth_total, max_sessions, sessions_per_peer)

        def serve(conn: socket.socket, source: str) -> None:
            promoted = False
            deadline = time.monotonic() + preauth_deadline_s
            try:
                if tls is not None:  # the handshake, too, within the pre-auth deadline
                    conn.settimeout(preauth_deadline_s)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conn = tls.server_context(verify_clients=True).wrap_socket(conn, server_side=True)
                conn.settimeout(timeout_s)
                snonce = secrets.token_hex(16)
                wire.send_msg(conn, {"v": 2, "nonce": snonce})
                hello = wire.recv_msg(conn, wire.MAX_HELLO, deadline)
                cnonce = hello.get("cnonce")
                if not isinstance(cnonce, str) or len(cnonce) > 64:
                    return
                t = wire.transcript(snonce, cnonce, wire.endpoint(conn.getsockname()),
                                    wire.endpoint(conn.getpeername()))
                refusal = None
                if not wire.verify(hello.get("proof"), wire.client_proof(secret, t)):
                    refusal = {"hello": False, "error": "unauthorized", "message": "bad or missing peer proof "
                               "(INFERSCALE_PEER_SECRET; a relayed session does not verify)"}
                elif not admission.promote(source):
                    refusal = {"hello": False, "error": "busy", "message": "too many peer sessions"}
                if refusal is not None:
                    hello_body = wire.canonical(hello)
                    wire.send_frame(conn, wire.signed(refusal, lambda b: wire.reply_mac(secret, t, hello_body, b))[1])
                    return
                promoted = True
                self._session(conn, Session(uuid.uuid4().hex, source, t))
            except (OSError, ValueError) as e:  # ssl.SSLError included: not TLS, or a certificate refused
                log.debug("peer connection from %s dropped: %s", source, e)
            finally:
                admission.leave(source, promoted)
                if isinstance(conn, ssl.SSLSocket):  # it took over the socket socketserver would close
                    conn.close()

        self.handler, self.on_close, self.secret, self.timeout_s = handler, on_close, secret, timeout_s

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request, client_address) -> None:
                source = client_address[0]
                if not admission.enter(source):  # no thread for a connection over its source's bound
                    try:
                        request.settimeout(0.2)
                        wire.send_msg(request, {"error": "busy", "message": "too many unauthenticated connections"})
                    except OSError:
                        pass
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    admission.leave(source, False)
                    raise

            def finish_request(self, request, client_address) -> None:
                serve(request, client_address[0])

        self._server = _Server((host, port), socketserver.BaseRequestHandler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvstore-peer", daemon=True)
        self._thread.start()

    def _session(self, conn: socket.socket, session: Session) -> None:
        secret = self.secret
        try:
            for seq in range(1, MAX_REQUESTS_PER_SESSION + 1):
                try:
                    frame = wire.recv_frame(conn, wire.MAX_REQUEST, time.monotonic() + self.timeout_s)
                except ConnectionError:
                    return  # the client is done
                body, auth = wire.unsigned(frame)  # the MAC is checked before anything of the frame is parsed
                msg = (wire.parse_bounded(body) if body and wire.verify(
                    auth, wire.request_mac(secret, session.transcript, body)) else {})
                if msg.get("seq") != seq:
                    reply = {"error": "unauthorized", "message": "bad peer request MAC or sequence number"}
                else:
                    reply = _safe(self.handler, {k: v for k, v in msg.items() if k != "seq"}, session)
                wire.send_frame(conn, wire.signed({**reply, "seq": seq},
                                                  lambda b: wire.reply_mac(secret, session.transcript, body, b))[1])
                if reply.get("error") == "unauthorized":
                    return
        finally:
            if self.on_close is not None:
                self.on_close(session)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
