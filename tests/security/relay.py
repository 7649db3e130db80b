"""A TCP relay in front of a peer port (a fake peer without the secret): forwards each connection byte for byte
(the real peer's nonce included) and keeps what each side sent."""

from __future__ import annotations

import socket
import struct
import threading

from inferscale.store import peer_protocol as wire


class Relay:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sent, self.received = bytearray(), bytearray()  # client -> peer, peer -> client
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
            threading.Thread(target=self._pipe, args=(client, upstream, self.sent), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.received), daemon=True).start()

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

    def close(self) -> None:
        self.srv.close()
