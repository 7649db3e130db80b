"""Limits before work on the tenant port (server/guard.py): an unauthenticated or oversized body is refused
before it is buffered. The RSS test runs a real server process and reads its /proc status."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
KEY = "isk-abuse-acme"
MiB = 1 << 20


def _reset_peak(pid: int) -> None:
    """Reset VmHWM to the current RSS (Linux: "5" > clear_refs), so a transient buffer counts from now."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass  # then VmHWM is the peak since start: a weaker check, never a false failure


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


@pytest.fixture(scope="module")
def server_proc(tmp_path_factory):
    data = tmp_path_factory.mktemp("abuse")
    env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, str(HERE / "abuse_server.py"), str(data), json.dumps({"acme": KEY})],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not start"
            time.sleep(0.2)
        yield proc, url
    finally:
        proc.terminate()
        proc.wait(10)


def _chunked_upload(url: str, path: str, total: int, headers: dict[str, str]) -> tuple[int | None, int]:
    """PUT ``total`` bytes with Transfer-Encoding: chunked over a raw socket, 1 MiB a chunk, while reading the
    answer; returns (status or None, bytes sent before the server stopped taking them)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = f"PUT {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.sendall(head.encode())
    sent, chunk = 0, b"%x\r\n" % MiB + b"A" * MiB + b"\r\n"
    answer: list[bytes] = []

    def read() -> None:
        try:
            answer.append(sock.recv(4096))
        except OSError:
            answer.append(b"")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while sent < total:
            sock.sendall(chunk)
            sent += MiB
        sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the server answered and closed: the rest of the flood is never read
    reader.join(30)
    sock.close()
    text = (answer[0] if answer else b"").decode("latin-1")
    status = int(text.split()[1]) if text.startswith("HTTP/") else None
    return status, sent


def test_64mib_chunked_body_without_key_is_refused_without_growing_rss(server_proc):
    proc, url = server_proc
    _reset_peak(proc.pid)
    before = _rss_kib(proc.pid, "VmHWM")  # the peak from here: a transient buffer shows up too
    status, _ = _chunked_upload(url, "/v1/memories/alice", 64 * MiB, {})
    time.sleep(0.5)
    grown_mib = (_rss_kib(proc.pid, "VmHWM") - before) / 1024
    print(f"peak RSS growth for a 64 MiB unauthenticated chunked body: {grown_mib:.1f} MiB")
    assert grown_mib < 32, f"server peak RSS grew by {grown_mib:.1f} MiB for an unauthenticated body"
    assert status == 401


def test_chunked_body_over_the_limit_with_a_key_is_413_and_not_buffered(server_proc):
    proc, url = server_proc
    _reset_peak(proc.pid)
    before = _rss_kib(proc.pid, "VmHWM")
    status, _ = _chunked_upload(url, "/v1/memories/alice", 64 * MiB, {"Authorization": f"Bearer {KEY}"})
    grown_mib = (_rss_kib(proc.pid, "VmHWM") - before) / 1024
    print(f"peak RSS growth for a 64 MiB chunked body over the limit: {grown_mib:.1f} MiB")
    assert grown_mib < 32, f"server peak RSS grew by {grown_mib:.1f} MiB for an over-limit body"
    assert status == 413
    assert httpx.get(url + "/healthz").status_code == 200


def test_every_route_counts_against_the_tenants_in_flight_limit(live):
    """Tenant 'tight' (max_in_flight 1): while one memories PUT holds its slot (its body still arriving), a GET
    of the memories API is 429 with Retry-After, and another tenant is served. Before, only chat counted."""
    from server_live_fixtures import KEYS

    host, port = live.url.removeprefix("http://").split(":")
    slow = socket.create_connection((host, int(port)), timeout=30)
    slow.sendall(f"PUT /v1/memories/bob HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['tight']}\r\n"
                 "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{\"\r\n".encode())
    try:
        time.sleep(0.3)
        r = httpx.get(f"{live.url}/v1/memories/bob", headers=live.headers("tight"), timeout=10)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert httpx.get(f"{live.url}/v1/models", headers=live.headers("globex"), timeout=10).status_code == 200
    finally:
        slow.close()
    deadline = time.time() + 10  # the slot comes back when the stalled request ends
    while httpx.get(f"{live.url}/v1/models", headers=live.headers("tight"), timeout=10).status_code == 429:
        assert time.time() < deadline, "the in-flight slot was never given back"
        time.sleep(0.1)


@pytest.mark.parametrize("plane", ["tenant", "internal"])
def test_a_wrong_credential_is_answered_before_the_body_arrives(live, plane):
    """Headers and the first chunk of a large chunked upload, with a wrong key: the 401 comes at once, while the
    client is still sending (before, the server waited for the whole body before looking at the key)."""
    base, path = (live.url, "/v1/memories/bob") if plane == "tenant" else (live.internal_url, "/internal/v1/purge")
    method = "PUT" if plane == "tenant" else "POST"
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer not-a-key\r\n"
              "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
              + b"%x\r\n" % MiB + b"A" * MiB + b"\r\n")
    s.settimeout(3)
    try:
        answer = s.recv(4096)
    except socket.timeout:
        answer = b""
    s.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer[:80]


def test_a_flood_from_one_tenant_is_refused_past_its_limit_while_another_is_served(live):
    """Tenant 'tight' (max_in_flight 1) sends 12 uploads and 12 chats at once; tenant globex asks meanwhile. The
    flood beyond tight's one slot is refused with 429 (memories uploads included), globex gets its answer."""
    import concurrent.futures as cf

    from server_live_fixtures import MODEL

    items = {"items": [{"id": f"f{i}", "text": f"the user went to paris {i}"} for i in range(20)]}

    def upload(n: int) -> int:
        return httpx.put(f"{live.url}/v1/memories/flood{n}", json=items, headers=live.headers("tight"),
                         timeout=120).status_code

    def chat(_: int) -> int:
        r = httpx.post(f"{live.url}/v1/chat/completions", headers=live.headers("tight"), timeout=120,
                       json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        return r.status_code

    with cf.ThreadPoolExecutor(24) as pool:
        flood = [pool.submit(upload, n) for n in range(12)] + [pool.submit(chat, n) for n in range(12)]
        time.sleep(0.1)
        answer = live.client("globex").chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "where did caroline go?"}])
        codes = [f.result() for f in flood]
    assert answer.choices[0].message.content is not None
    assert set(codes) <= {200, 429} and codes[:12].count(429) >= 1, codes
