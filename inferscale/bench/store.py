"""``inferscale bench store``: bring 50 memory blocks into DRAM from each source, NIXL vs the plain way.

Rows (medians over repeats, same bytes, same run):
  disk  NIXL POSIX, one request for all blobs       vs  Python open().readinto per file
  peer  the owner's NIXL UCX WRITE into this         vs  the same bytes over a plain TCP socket between the same
        process's exposed slots, in a kept session      two processes: one kept connection (as the session is),
        (the fleet path's pull: the sizes known from    a request, sendall of each image from the owner's arena,
        the peer's index, one ``pull`` round trip;      recv_into a preallocated huge-page buffer (the kind of
        ``peer-locate``: without them, ``locate``       memory the arena is); the two alternate repeat by
        then ``write``, two round trips)                repeat, so both see the same machine load
  dram  KVStore.get_many, all blocks DRAM-resident  vs  torch.Tensor.copy_ of the same bytes (warm destination)
        (zero-copy views of the arena; ``dram-copy`` is the copy=True variant, against fresh-memory copies)
Plus end-to-end store rows (checksums verified; pulls also written to disk) against the plain way doing the
same verification, so the cost of integrity is visible rather than hidden, and ``disk+unseal``: the same cold
get_many from a store whose blobs are sealed at rest (AES-256-GCM open into the DRAM slot, no sha256) against the
unsealed store's ``disk+verify``: the cost of encryption at rest, side by side. Page cache is warm for both disk
paths (both read the same files right after each other).

``--kv-dtype bf16,int8,...`` runs the whole set once per storage format (``inferscale.kvquant``): bf16 blocks
are bfloat16 (the GPU serving dtype), compact ones are those quantized; every row carries ``kv_dtype`` and
``bytes_per_token`` (KV plus scales, what a tier holds per token), so the formats' sizes and speeds sit side by
side."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import socket
import statistics
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

# Gemma-3-270M, the default model: 18 layers, 1 KV head, head_dim 256; float blocks in bf16, as a GPU holds them.
GEMMA3_270M_LAYERS = 18
GEMMA3_270M_KV_HEADS = 1
GEMMA3_270M_HEAD_DIM = 256
KV_DTYPE = torch.bfloat16
TENANT, USER = "bench", "locomo-user"
FINGERPRINT = "bench-" + "0" * 58
BARS = {"disk": 0.5, "dram": 0.8, "peer": 1.5}  # NIXL path bandwidth / baseline bandwidth must reach this (issue 23)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="OUT", help="write the rows as JSON here")
    p.add_argument("--blocks", type=int, default=50)
    p.add_argument("--min-tokens", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=35)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="work directory (default: a temp dir, removed after)")
    p.add_argument("--kv-dtype", default="bf16",
                   help="comma list of storage formats to run (bf16, int8, fp8, int4; default %(default)s)")


def make_blocks(n: int, lo: int, hi: int, seed: int, kv_dtype: str = "bf16"):
    from inferscale.kvformat import KVBlock
    from inferscale.kvformat import compact

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = int(torch.randint(lo, hi + 1, (1,), generator=g))
        kv = torch.randn(GEMMA3_270M_LAYERS, 2, GEMMA3_270M_KV_HEADS, t, GEMMA3_270M_HEAD_DIM, generator=g,
                         dtype=KV_DTYPE)
        b = KVBlock(f"m{i:03d}", f"memory {i}", list(range(t)), 0, kv, FINGERPRINT, "p" * 64,
                    embedding=torch.randn(384, generator=g))
        out.append(b if kv_dtype == "bf16" else compact(b, kv_dtype))
    return out


def bytes_per_token(blocks) -> float:
    """KV bytes a tier holds per token (compact tensor plus scales; no header or embedding)."""
    return sum(b.nbytes for b in blocks) / sum(b.num_tokens for b in blocks)


def median_s(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None) -> float:
    fn() if setup is None else (setup(), fn())  # warm-up
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_times(fn: Callable[[], Any], baseline: Callable[[], Any], repeats: int,
                 after: Callable[[], Any] | None = None) -> tuple[list[float], list[float]]:
    """Times of ``fn`` and ``baseline``, alternating repeat by repeat (after one warm-up each): on a shared
    machine both then see the same load, and their medians compare. ``after`` runs untimed after each ``fn``
    (the benchmark's own cleanup, e.g. giving back the slots a pull filled)."""
    fn(), after() if after else None, baseline()
    a, b = [], []
    for _ in range(repeats):
        for f, out in ((fn, a), (baseline, b)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
            if f is fn and after is not None:
                after()
    return a, b


def spread_ms(times: list[float]) -> list[float]:
    """[min, 25th percentile, 75th percentile, max] in ms."""
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return [round(x * 1e3, 3) for x in (min(times), q[0], q[2], max(times))]


def row(source: str, nblocks: int, nbytes: int, s: float, baseline: str, bs: float) -> dict[str, Any]:
    gbps, bgbps = nbytes / s / 1e9, nbytes / bs / 1e9
    r = {"source": source, "blocks": nblocks, "bytes": nbytes, "ms": round(s * 1e3, 3), "gbps": round(gbps, 3),
         "baseline": baseline, "baseline_gbps": round(bgbps, 3), "baseline_ms": round(bs * 1e3, 3),
         "ratio": round(gbps / bgbps, 3)}
    if source in BARS:
        r["bar"] = BARS[source]
        r["pass"] = gbps / bgbps >= BARS[source]
    return r


# -- the peer process: a KVStore serving NIXL pulls, plus a plain socket serving the same arena bytes ------------
def _peer_main(root: str, budget: int, secret: str, conn) -> None:
    from inferscale.store.store import KVStore

    store = KVStore(root, dram_budget_bytes=budget, peer_port=0, peer_host="127.0.0.1", node="127.0.0.1",
                    peer_secret=secret)
    ids = [i.item_id for i in store.list(TENANT, USER)]
    store.get_many(TENANT, USER, ids, FINGERPRINT)  # DRAM-resident, as a serving node holds them
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_serve_connection, args=(c,), daemon=True).start()

    def _serve_connection(c: socket.socket) -> None:
        with c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while _serve_one(c):  # keep-alive: requests until the client closes
                pass

    def _serve_one(c: socket.socket) -> bool:
        head = _recv_exactly(c, 4)
        if head is None:
            return False
        (n,) = struct.unpack(">I", head)
        want = json.loads(_recv_exactly(c, n) or b"{}")
        # The same bytes NIXL moves: each blob image straight from the DRAM arena, no extra copy.
        entries = [store.dram.acquire((want["tenant"], want["user"], FINGERPRINT, i)) for i in want["items"]]
        try:
            c.sendall(struct.pack(">Q", sum(e.size for e in entries)))
            for e in entries:
                c.sendall(store.arena.view(e.offset, e.size))
        finally:
            for e in entries:
                store.dram.release(e)
        return True

    threading.Thread(target=serve, daemon=True).start()
    conn.send({"peer": store.peer_address, "socket": srv.getsockname()[1]})
    try:
        conn.recv()
    except EOFError:
        pass
    srv.close()
    store.close()


def _recv_exactly(c: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None when the peer closed first."""
    buf = b""
    while len(buf) < n:
        piece = c.recv(n - len(buf))
        if not piece:
            return None
        buf += piece
    return buf


def socket_connect(port: int) -> socket.socket:
    """One keep-alive connection to the peer's plain socket server (the NIXL pulls keep their session too)."""
    c = socket.create_connection(("127.0.0.1", port), timeout=30)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return c


def socket_fetch(c: socket.socket, items: list[str], out: memoryview) -> int:
    req = json.dumps({"tenant": TENANT, "user": USER, "items": items}).encode()
    c.sendall(struct.pack(">I", len(req)) + req)
    hdr = _recv_exactly(c, 8)
    if hdr is None:
        raise ConnectionError("the socket server closed the connection")
    (total,) = struct.unpack(">Q", hdr)
    got = 0
    while got < total:
        k = c.recv_into(out[got:total])
        if k == 0:
            raise ConnectionError("short read")
        got += k
    return got


# -- the benchmark ------------------------------------------------------------------------------------------
def bench(work: Path, args: argparse.Namespace, kv_dtype: str = "bf16") -> list[dict[str, Any]]:
    from inferscale.bench.node import child_process
    from inferscale.store.store import KVStore

    blocks = make_blocks(args.blocks, args.min_tokens, args.max_tokens, args.seed, kv_dtype)
    src_root, dst_root = work / "node-a", work / "node-b"
    with KVStore(src_root, dram_budget_bytes=256 << 20, nixl=False) as w:
        for b in blocks:
            w.put(TENANT, USER, b, cache=False)
    # The same blocks sealed at rest, as a server stores them.
    from inferscale.sealing import ensure_kek_file

    sealed_root, keyring = work / "node-a-sealed", ensure_kek_file(work / "kek")
    with KVStore(sealed_root, dram_budget_bytes=256 << 20, nixl=False, keyring=keyring) as w:
        for b in blocks:
            w.put(TENANT, USER, b, cache=False)
    ids = [b.item_id for b in blocks]
    n = len(blocks)
    rows: list[dict[str, Any]] = []

    with KVStore(src_root, dram_budget_bytes=256 << 20) as st:
        infos = st.list(TENANT, USER)
        paths, sizes = [i.path for i in infos], [i.size for i in infos]
        total = sum(sizes)
        budget = 4 * total + (64 << 20)
    reps = args.repeats

    # -- disk -> DRAM -----------------------------------------------------------------------------------
    with KVStore(src_root, dram_budget_bytes=budget) as st:
        offsets, _ = st.dram.reserve(TENANT, sizes)

        def nixl_disk() -> None:
            fds = [os.open(p, os.O_RDONLY) for p in paths]
            try:
                st.transport.read_files(list(zip(fds, sizes)), offsets)
            finally:
                for fd in fds:
                    os.close(fd)

        staging = memoryview(bytearray(total))

        def plain_disk(verify: bool = False) -> None:
            pos = 0
            for p, s in zip(paths, sizes):
                with open(p, "rb", buffering=0) as f:
                    f.readinto(staging[pos : pos + s])
                if verify:
                    hashlib.sha256(staging[pos : pos + s]).hexdigest()
                pos += s

        t_nixl = median_s(nixl_disk, reps)
        t_plain = median_s(plain_disk, reps)
        for (o, s) in [(offsets[0], sizes[0])]:  # the NIXL read put the real file bytes in the arena
            assert bytes(st.arena.view(o, s)) == Path(paths[0]).read_bytes()
        rows.append(row("disk", n, total, t_nixl, "python open().readinto", t_plain))
        st.dram.abort(TENANT, offsets, sizes)

        def cold_get() -> None:
            st.get_many(TENANT, USER, ids, FINGERPRINT)

        t_store = median_s(cold_get, reps, setup=lambda: st.dram.drop(lambda k: True))
        t_plainv = median_s(lambda: plain_disk(True), reps)
        rows.append(row("disk+verify", n, total, t_store, "readinto + sha256", t_plainv))
        with KVStore(sealed_root, dram_budget_bytes=budget, keyring=keyring) as sealed:
            t_sealed = median_s(lambda: sealed.get_many(TENANT, USER, ids, FINGERPRINT), reps,
                                setup=lambda: sealed.dram.drop(lambda k: True))
        rows.append(row("disk+unseal", n, total, t_sealed, "disk+verify (unsealed store)", t_store))

        # -- DRAM hit ---------------------------------------------------------------------------------------
        st.get_many(TENANT, USER, ids, FINGERPRINT)
        src = torch.empty(total, dtype=torch.uint8)
        src.copy_(torch.frombuffer(staging, dtype=torch.uint8))
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in: the baseline copies into warm memory
        t_hit = median_s(lambda: st.get_many(TENANT, USER, ids, FINGERPRINT), reps)
        t_copy = median_s(lambda: dst.copy_(src), reps)
        rows.append(row("dram", n, total, t_hit, "torch.Tensor.copy_", t_copy))
        # Owned copies land in fresh memory, whose first touch (page faults) dominates on VMs: compare with
        # the plain way paying the same, torch.empty + copy_ per block.
        parts = [src[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(n)]
        t_hitc = median_s(lambda: st.get_many(TENANT, USER, ids, FINGERPRINT, copy=True), reps)
        t_fresh = median_s(lambda: [torch.empty_like(p).copy_(p) for p in parts], reps)
        rows.append(row("dram-copy", n, total, t_hitc, "torch.empty + copy_ per block", t_fresh))

    from inferscale.store.arena import huge_page_buffer
    from inferscale.store.pulling import fetch_leased, peer_index

    # -- peer process -> DRAM -------------------------------------------------------------------------------
    secret = secrets.token_hex(16)  # this run's INFERSCALE_PEER_SECRET
    with child_process(_peer_main, str(src_root), budget, secret, start_timeout_s=120, stop_timeout_s=30) as info:
        with KVStore(dst_root, dram_budget_bytes=budget, peer_secret=secret) as st:
            index = peer_index(st, TENANT, USER, info["peer"], FINGERPRINT)  # the fleet path's first question

            landed: list[tuple[list[int], list[int]]] = []

            def nixl_peer(known: list[int] | None) -> None:
                got, offs = fetch_leased(st, TENANT, USER, info["peer"], ids, FINGERPRINT, None, known)
                landed.append((offs, [g["size"] for g in got]))

            def give_back() -> None:  # untimed: the bench's cleanup, not part of a pull
                offs, sizes_ = landed.pop()
                st.dram.abort(TENANT, offs, sizes_)

            buf = memoryview(huge_page_buffer(total).numpy())
            conn = socket_connect(info["socket"])
            for source, known in (("peer", [index.sizes[i] for i in ids]), ("peer-locate", None)):
                ucx_times, sock_times = paired_times(lambda: nixl_peer(known), lambda: socket_fetch(conn, ids, buf),
                                                     2 * reps, after=give_back)
                rows.append({**row(source, n, total, statistics.median(ucx_times), "tcp socket (same processes)",
                                   statistics.median(sock_times)),
                             "ms_spread": spread_ms(ucx_times), "baseline_ms_spread": spread_ms(sock_times)})

            def sock_verify() -> None:
                socket_fetch(conn, ids, buf)
                pos = 0
                for s in sizes:
                    hashlib.sha256(buf[pos : pos + s]).hexdigest()
                    pos += s

            few = max(1, min(reps, 5))  # each pull also writes (and fsyncs) 50 files
            t_pull = median_s(lambda: st.pull_from_peer(TENANT, USER, info["peer"], ids), few)
            t_sockv = median_s(sock_verify, few)
            rows.append(row("peer+verify+persist", n, total, t_pull, "tcp socket + sha256", t_sockv))
            conn.close()
            got, _ = st.get_many(TENANT, USER, ids[:1], FINGERPRINT)
            assert torch.equal(got[0].kv.view(torch.uint8), blocks[0].kv.view(torch.uint8))  # fp8 has no equal
    per_token = round(bytes_per_token(blocks), 1)
    return [{"kv_dtype": kv_dtype, "bytes_per_token": per_token, **r} for r in rows]


def print_table(rows: list[dict[str, Any]]) -> None:
    sizes = {r["kv_dtype"]: r["bytes_per_token"] for r in rows}
    base = sizes.get("bf16")
    for fmt, bpt in sizes.items():
        print(f"kv_dtype {fmt:<5} {bpt:>9.1f} bytes/token" + (f"  ({bpt / base:.3f}x bf16)" if base else ""))
    head = f"{'kv_dtype':<9}{'source':<22}{'blocks':>7}{'MB':>8}{'ms':>9}{'GB/s':>8}   {'baseline':<30}{'ms':>9}{'GB/s':>8}{'ratio':>7}  bar"
    print(head)
    print("-" * len(head))
    for r in rows:
        bar = f"{'PASS' if r['pass'] else 'FAIL'} (>= {r['bar']:.0%})" if "bar" in r else "-"
        print(f"{r['kv_dtype']:<9}{r['source']:<22}{r['blocks']:>7}{r['bytes'] / 1e6:>8.1f}{r['ms']:>9.2f}{r['gbps']:>8.2f}   "
              f"{r['baseline']:<30}{r['baseline_ms']:>9.2f}{r['baseline_gbps']:>8.2f}{r['ratio']:>7.2f}  {bar}")
    for r in rows:
        if "ms_spread" in r:
            print(f"{r['kv_dtype']} {r['source']} ms min/p25/p75/max: {r['ms_spread']}, baseline {r['baseline_ms_spread']}")


def run(args: argparse.Namespace) -> int:
    from inferscale.kvquant import parse_kv_dtypes

    formats = parse_kv_dtypes(getattr(args, "kv_dtype", "bf16"))
    if args.dir:
        work = Path(args.dir)
        work.mkdir(parents=True, exist_ok=True)
        rows = [r for f in formats for r in bench(work / f, args, f)]
    else:
        with tempfile.TemporaryDirectory(prefix="inferscale-bench-store-") as d:
            rows = [r for f in formats for r in bench(Path(d) / f, args, f)]
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0
