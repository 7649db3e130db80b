"""The peer control protocol's messages (G4): frames, a bounded JSON reader, and the MACs of a session.

Frames: 4-byte big-endian length + one JSON object. A session (one TCP connection) runs:

1. server -> client ``{"v": 2, "nonce": sn}``                           (greeting, fresh per connection)
2. client -> server ``{"cnonce": cn, "proof": MAC("client-hello", T)}``  (the client proves the secret)
3. any number of ``request -> reply`` pairs; a request carries ``"seq"`` and ``"auth": MAC("request", T,
   request)``, its reply ``"auth": MAC("reply", T, sha256(request), reply)`` (errors and ``not_found`` too).
   Each is a signed frame (``signed``): the message's canonical JSON, then ``"auth"`` added as its last field, so
   the MAC covers exactly the bytes before it and a receiver checks it before it parses anything.

``T``, the transcript, binds both nonces and both peer identities: the server's and the client's TCP endpoints
(ip:port) as each side sees them on this connection. A relay (a fake peer that forwards a real peer's nonce)
holds two connections with two different endpoint pairs, so nothing it relays verifies at the other end. Each
MAC names its role (domain separation): no party MACs text of the other role, so neither side is a signing
oracle for the other. The secret (``INFERSCALE_PEER_SECRET``) never travels."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import socket
import struct
import time
from typing import Any, Callable

PROTOCOL = b"inferscale-peer/2"
MAX_GREETING = 1 << 10
MAX_HELLO = 1 << 10  # the only frame read before the client has proved the secret
MAX_REQUEST = 1 << 20
MAX_REPLY = 8 << 20  # index: one float32 embedding per item
MAX_DEPTH = 8  # JSON nesting of any frame; the messages above nest at most 3 deep
MIN_SECRET_CHARS = 16

_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string; unrolled: runs of plain bytes in one step
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class FrameError(ValueError):
    """A frame over its size or depth bound, or not a JSON object."""


def check_secret(secret: str | None, what: str = "INFERSCALE_PEER_SECRET") -> str:
    from inferscale.errors import ConfigError

    if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(f"{what} must be set, at least {MIN_SECRET_CHARS} characters: the peer plane has no "
                          "access without it")
    return secret


def parse_bounded(data: bytes, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """``data`` as a JSON object, refusing nesting deeper than ``max_depth`` before the parser sees it (a deeply
    nested frame would otherwise exhaust the parser's recursion). The check strips strings, keeps the brackets
    and removes innermost pairs a level a pass, at C speed: what is left after ``max_depth`` passes nests deeper
    (or does not pair up, which is no JSON either)."""
    shape = _STRINGS.sub(b"", data).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not shape:
            break
        shape = shape.replace(b"[]", b"").replace(b"{}", b"")
    if shape:
        raise FrameError(f"frame nests deeper than {max_depth}")
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise FrameError(f"frame is not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise FrameError("a frame that is not a JSON object")
    return msg


def send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """``n`` bytes, read in pieces (nothing is allocated for bytes that never arrive); by ``deadline``
    (monotonic) when given, however slowly they trickle in."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("peer frame deadline passed")
            sock.settimeout(left)
        piece = sock.recv(min(n - len(buf), 1 << 16))
        if not piece:
            raise ConnectionError("peer closed the connection")
        buf += piece
    return bytes(buf)


def send_frame(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(struct.pack(">I", len(frame)) + frame)


def recv_frame(sock: socket.socket, limit: int = MAX_REPLY, deadline: float | None = None) -> bytes:
    """One frame's bytes, unparsed (at most ``limit``)."""
    (n,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if n > limit:
        raise FrameError(f"frame of {n} bytes announced, over the {limit}-byte limit")
    return _recv_exact(sock, n, deadline)


def recv_msg(sock: socket.socket, limit: int = MAX_REPLY, deadline: float | None = None) -> dict[str, Any]:
    return parse_bounded(recv_frame(sock, limit, deadline))


def endpoint(addr: tuple[Any, ...]) -> str:
    """``ip:port`` of a socket address (IPv4 or IPv6 tuple)."""
    return f"{addr[0]}:{addr[1]}"


def canonical(msg: dict[str, Any]) -> bytes:
    """The bytes a MAC covers: every field but "auth", keys sorted, no whitespace."""
    return json.dumps({k: v for k, v in msg.items() if k != "auth"}, sort_keys=True, separators=(",", ":")).encode()


def transcript(snonce: str, cnonce: str, server_ep: str, client_ep: str) -> bytes:
    return json.dumps([snonce, cnonce, server_ep, client_ep], separators=(",", ":")).encode()


def _mac(secret: str, role: bytes, *parts: bytes) -> str:
    h = hmac.new(secret.encode(), PROTOCOL + b"\0" + role, hashlib.sha256)
    for p in parts:  # length-prefixed: no two part lists give the same bytes
        h.update(struct.pack(">Q", len(p)) + p)
    return h.hexdigest()


def client_proof(secret: str, t: bytes) -> str:
    return _mac(secret, b"client-hello", t)


def request_mac(secret: str, t: bytes, body: bytes) -> str:
    """The MAC of a request whose ``canonical`` bytes are ``body`` (made once: the reply's MAC covers them too)."""
    return _mac(secret, b"request", t, body)


def reply_mac(secret: str, t: bytes, request_body: bytes, reply_body: bytes) -> str:
    """The MAC of the reply whose body is ``reply_body`` to the request whose body is ``request_body``."""
    return _mac(secret, b"reply", t, hashlib.sha256(request_body).digest(), reply_body)


_AUTH_FIELD = b',"auth":"'
_MAC_HEX = 64  # hex HMAC-SHA256
_AUTH_TAIL = len(_AUTH_FIELD) + _MAC_HEX + len(b'"}')


def signed(msg: dict[str, Any], mac: Callable[[bytes], str]) -> tuple[bytes, bytes]:
    """(body, frame) of a non-empty message: the body is ``canonical(msg)``; the frame is that object with
    ``"auth": mac(body)`` added as its last field (still one JSON object). Serialized once: the MAC is over the
    bytes sent, not over a re-serialization the receiver would have to make again."""
    body = canonical(msg)
    return body, body[:-1] + _AUTH_FIELD + mac(body).encode() + b'"}'


def unsigned(frame: bytes) -> tuple[bytes, str]:
    """(body, auth) of a signed frame; (b"", "") when it does not end with an auth field of that form."""
    cut = len(frame) - _AUTH_TAIL
    if cut < 1 or frame[cut : cut + len(_AUTH_FIELD)] != _AUTH_FIELD or not frame.endswith(b'"}'):
        return b"", ""
    return frame[:cut] + b"}", frame[cut + len(_AUTH_FIELD) : -2].decode("ascii", "replace")


def verify(got: Any, expected: str) -> bool:
    return isinstance(got, str) and hmac.compare_digest(got.encode(), expected.encode())
