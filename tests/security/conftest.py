"""The attack matrix of the trust boundary (ARCHITECTURE.md, "Trust boundary"). Server-plane attacks run against
the same live server as tests/server (tenant listener + internal listener on loopback); peer-plane attacks use
real NIXL agents in a second process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("server_live_fixtures",
                                               Path(__file__).resolve().parents[1] / "server" / "conftest.py")
_server = importlib.util.module_from_spec(_spec)
sys.modules["server_live_fixtures"] = _server
_spec.loader.exec_module(_server)

# The live server and what it is built from (session-scoped; see tests/server/conftest.py).
live, tiny_engine, embedder = _server.live, _server.tiny_engine, _server.embedder
