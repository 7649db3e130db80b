"""The production app behind uvicorn on a free loopback port, in a thread of this process: what the benches that
drive the real server over HTTP (``bench load``, ``bench isolation``) run against."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from inferscale.errors import ConfigError


class LoopbackServer:
    def __init__(self, app: Any, *, start_timeout_s: float = 120.0, port: int = 0) -> None:
        import uvicorn

        if not port:  # any free one
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + start_timeout_s
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise ConfigError(f"bench: the server did not start within {start_timeout_s:.0f} s")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
