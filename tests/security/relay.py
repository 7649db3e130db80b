"""Fake peers on loopback without the secret: ``Listener`` runs a handler per connection; ``Relay`` forwards each
connection to a real peer byte for byte (the real peer's nonce included) and keeps what each side sent."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable

from inferscale.store import peer_protocol as wire


class Listener:
    """Accepts on a loopback port and runs ``handle(connection)`` in a thread per connection."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self.handle = handle
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.srv.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self.srv.close()


class Relay(Listener):
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sent, self.received = bytearray(), bytearray()  # client -> peer, peer -> client
        super().__init__(self._relay)

    def _relay(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(upstream, client, self.received), daemon=True).start()
        self._pipe(client, upstream, self.sent)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        try:
            while data := src.recv(65536):
                record += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def frames_received(self) -> list[dict]:
        """The frames the real peer sent back through the relay."""
        out, buf = [], bytes(self.received)
        while len(buf) >= 4:
            (n,) = struct.unpack(">I", buf[:4])
            out.append(wire.parse_bounded(buf[4 : 4 + n]))
            buf = buf[4 + n :]
        return out
