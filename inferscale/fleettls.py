"""The fleet's TLS: the internal API (operator -> server) and the peer control channel (server <-> server).

One CA (the chart's Secret ``<fullname>-tls``: ``ca.crt``) signs one certificate for the serving pods (``tls.crt``,
``tls.key``) whose names are the headless Service's. Clients connect to a pod's IP but check the certificate for
the fleet's server name (``INFERSCALE_TLS_SERVER_NAME``, also sent as SNI), so no pod IP needs to be known when the
certificate is made, and a pod recreated under a new IP still verifies. TLS 1.3 only: both ends are ours.

The peer plane is mutual (a peer presents the fleet certificate too and the server verifies it against the CA);
its MACs over INFERSCALE_PEER_SECRET remain the authorization. The internal API is server-authenticated only: the
internal token is its authorization (why: docs/interfaces.md, "TLS").

The files are read again when they change (the kubelet rewrites a mounted Secret in place), so the certificate a
re-rendered chart issues is used from the next handshake on, without a restart."""

from __future__ import annotations

import functools
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from inferscale.errors import ConfigError
from inferscale.secretfile import check_private

ENV_CERT, ENV_KEY = "INFERSCALE_TLS_CERT_FILE", "INFERSCALE_TLS_KEY_FILE"
ENV_CA, ENV_NAME = "INFERSCALE_TLS_CA_FILE", "INFERSCALE_TLS_SERVER_NAME"


@dataclass(frozen=True)
class FleetTls:
    """The CA the fleet trusts and the name its servers prove; a serving pod also holds the certificate and key."""

    ca_file: Path
    server_name: str
    cert_file: Path | None = None
    key_file: Path | None = None

    @classmethod
    def from_files(cls, ca: str | os.PathLike | None, server_name: str | None, cert: str | os.PathLike | None = None,
                   key: str | os.PathLike | None = None, *, server: bool) -> FleetTls | None:
        """None when nothing is set; ConfigError when only part is (a server needs all four, the operator the CA
        and the name) or a file is unusable (the key readable by others, a certificate that does not load)."""
        given = {ENV_CA: ca, ENV_NAME: server_name, **({ENV_CERT: cert, ENV_KEY: key} if server else {})}
        if not any(given.values()):
            return None
        missing = [name for name, value in given.items() if not value]
        if missing:
            raise ConfigError(f"TLS needs {', '.join(given)} together; missing: {', '.join(missing)}")
        tls = cls(Path(ca), str(server_name), Path(cert) if server else None, Path(key) if server else None)
        return tls.checked()

    def checked(self) -> FleetTls:
        if self.key_file is not None:
            check_private(self.key_file, ENV_KEY)
            self.server_context(verify_clients=True)
        self.client_context()
        return self

    def client_context(self) -> ssl.SSLContext:
        """Verifies a server against the CA and ``server_name`` (pass it as ``server_hostname``); presents the
        fleet certificate when this side holds one (the peer plane's client)."""
        return _context(self, "client", _stamp(self))

    def server_context(self, *, verify_clients: bool) -> ssl.SSLContext:
        """Serves the fleet certificate; with ``verify_clients`` a client must present one signed by the CA."""
        return _context(self, "mutual" if verify_clients else "server", _stamp(self))

    def reloading_server_context(self, *, verify_clients: bool) -> ssl.SSLContext:
        """A server context that hands each handshake the current files' context (for a listener that takes one
        context at start, such as uvicorn's)."""
        ctx = self.server_context(verify_clients=verify_clients)

        def fresh(conn: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _ctx: ssl.SSLContext) -> None:
            conn.context = self.server_context(verify_clients=verify_clients)

        ctx.sni_callback = fresh
        return ctx


def _stamp(tls: FleetTls) -> tuple[int, ...]:
    """What changes when a file is rewritten (a rotated Secret): each file's mtime and size."""
    files = [f for f in (tls.ca_file, tls.cert_file, tls.key_file) if f is not None]
    try:
        stats = [os.stat(f) for f in files]
    except OSError as e:
        raise ConfigError(f"TLS file {e.filename}: cannot read ({e.strerror or e})") from None
    return tuple(v for st in stats for v in (st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=16)
def _context(tls: FleetTls, role: str, _stamp: tuple[int, ...]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT if role == "client" else ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        if role != "server":  # a client checks the server, a mutual server the client, against the CA
            ctx.load_verify_locations(cafile=tls.ca_file)
        if tls.cert_file is not None and tls.key_file is not None:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"TLS files ({ENV_CA} {tls.ca_file}, {ENV_CERT} {tls.cert_file}): cannot load "
                          f"({getattr(e, 'strerror', None) or e})") from None
    if role == "client":
        ctx.check_hostname, ctx.verify_mode = True, ssl.CERT_REQUIRED
    else:
        ctx.num_tickets = 0  # no resumption: every session is one full handshake, nothing else to read after it
        if role == "mutual":
            ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
