"""``bench load``'s clients: the official ``openai`` async client, in a process of their own, as users' are.

The server runs in the bench's process (its engine is read there: the floor, the requests in the engine); the
clients do not. In one process the SDK's parsing of every streamed chunk would hold the server's GIL between the
engine thread's operations and count against the server (issue 22): aiperf and real users parse in processes of
their own. Each measurement spawns one client process (``multiprocessing``'s spawn start: no fork of a process
holding torch's threads) and gets its result back through a queue; what the flood needs to know of the engine while
it runs crosses as two events and a counter.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from inferscale.errors import ConfigError

QUESTION = "What did Maya do last summer, and with whom?"
KEYS = {"bench-a": "isk-bench-a", "bench-b": "isk-bench-b"}
PROBES = 3  # tenant B's requests, idle and during the flood (medians)
B_K = 3  # tenant B's memories per request: a short kv prompt
RESULT_TIMEOUT_S = 3600.0
# A refusal this long after its request was sent did not come at admission: a kept request shed later, once the
# measured costs said it would outwait the queue timeout (issue 22's bar: A's excess refused in < 1 s).
LATE_REFUSAL_S = 1.0


@dataclass
class Stream:
    ttft_s: float
    tpot_s: float | None  # (last token - first token) / (tokens - 1)
    tokens: int
    times: tuple[float, ...] = ()  # perf_counter of every chunk with visible content

    @property
    def first_t(self) -> float | None:  # the first visible content
        return self.times[0] if self.times else None

    @property
    def last_t(self) -> float | None:  # the last visible content
        return self.times[-1] if self.times else None


class FloodSignals(TypedDict):
    """Shared between the bench and the flood's client process."""

    # A's requests refused or answered so far (a short answer can end before the last of the burst is in)
    ended: multiprocessing.sharedctypes.Synchronized
    go: multiprocessing.synchronize.Event  # set by the bench: each of A's requests is in the engine or ended
    probed: multiprocessing.synchronize.Event  # set by the client: B's probes during the flood are done


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def concurrent(url: str, model: str, mode: str, asks: list[tuple[str, str]], k: int, tokens: int,
               extra: dict | None = None) -> dict:
    """One concurrent stream for each of ``asks`` (its user and question), and one more arriving while all but one
    decode, measured in a client process; ``extra``: more request fields for each (``bench load --extra-body``)."""
    return _spawned(_concurrent, url, model, mode, asks, k, tokens, extra or {})


def flood(url: str, model: str, k: int, tokens: int, requests: int, in_engine: Callable[[], int],
          words: int = 0, mode: str = "text", running: Callable[[], int] | None = None) -> dict:
    """Tenant A's flood and tenant B's probes, in a client process; ``in_engine()`` counts A's requests in the
    engine (read in the bench's process: no endpoint shows load to a tenant); ``words``: A's question comes after
    that many words of a pasted document (``long_question``); ``mode``: A's requests' (``kv``: a hold of the
    slots, each answer ``tokens`` long). With ``running`` (the engine's running requests) B asks once each of A's
    requests runs or has ended, not while some still queue for their prompts (B, a tenant not served yet, would go
    ahead of them: B's first token came at 1.2-2.0x idle where the slots it waited for once A's were all running
    gave it at ~29 s)."""
    ctx = multiprocessing.get_context("spawn")
    signals = FloodSignals(ended=ctx.Value("i", 0), go=ctx.Event(), probed=ctx.Event())
    seen: dict[str, int] = {}

    def watch() -> None:
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        placed = running or in_engine
        while not signals["go"].is_set() and time.monotonic() < deadline:
            if placed() + signals["ended"].value >= requests:
                signals["go"].set()
            time.sleep(0.005)
        if signals["probed"].wait(RESULT_TIMEOUT_S):
            seen["after"] = in_engine()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    steal0 = steal_s()
    result = _spawned(_flood, url, model, k, tokens, requests, signals, long_question(words), mode, ctx=ctx)
    steal1 = steal_s()
    watcher.join(5)
    result["a_in_engine_after_probes"] = seen.get("after")
    result["host_steal_s"] = steal1 - steal0 if steal0 is not None and steal1 is not None else None
    return result


def steal_s() -> float | None:
    """CPU seconds the hypervisor ran something else while this machine's cores wanted to run (the steal column
    of /proc/stat, all cores): a flood whose passes slowed for seconds with no change of load shows it here, not
    in the server. None where the kernel does not count it."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _spawned(target, *args, ctx=None) -> dict:
    ctx = ctx or multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(target, args, results), daemon=True)
    proc.start()
    try:
        ok, value = results.get(timeout=RESULT_TIMEOUT_S)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if not ok:
        raise ConfigError(f"bench load: the client process failed: {value}")
    return value


def _child(target, args: tuple, results) -> None:
    try:
        results.put((True, asyncio.run(target(*args))))
    except Exception as e:  # noqa: BLE001 - reported to the bench, which raises it
        results.put((False, f"{type(e).__name__}: {e}"))


async def _stream(client, model: str, mode: str, k: int, tokens: int, question: str = QUESTION,
                  user: str = "maya", first: asyncio.Event | None = None, extra: dict | None = None) -> Stream:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, user=user, stream=True, max_tokens=tokens, messages=[{"role": "user", "content": question}],
        stream_options={"include_usage": True},
        extra_body={"inferscale": {"k": k, "mode": mode}, "ignore_eos": True, **(extra or {})})
    times, used = [], 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:  # visible content: what TTFT ends at
            times.append(time.perf_counter())
            if first is not None and len(times) == 1:
                first.set()
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    if first is not None:
        first.set()
    ttft = (times[0] if times else time.perf_counter()) - t0
    tpot = (times[-1] - times[0]) / (used - 1) if len(times) >= 2 and used > 1 else None
    return Stream(ttft, tpot, used, tuple(times))


async def _concurrent(url: str, model: str, mode: str, asks: list[tuple[str, str]], k: int, tokens: int,
                      extra: dict) -> dict:
    from openai import AsyncOpenAI

    n = len(asks)
    client = AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["bench-a"], max_retries=0, timeout=3600)
    await _stream(client, model, mode, k, 1)  # the client's first request pays its connection and first-use costs
    idle = statistics.median([(await _stream(client, model, mode, k, tokens, extra=extra)).ttft_s
                              for _ in range(PROBES)])
    t0, cpu0 = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*(_stream(client, model, mode, k, tokens, question, user, extra=extra)
                                     for user, question in asks))
    wall = time.perf_counter() - t0
    # The cores this client process used meanwhile (the SDK parsing every chunk): on a machine the server shares,
    # taken from the server's engine threads, which a client elsewhere would not take.
    client_cores = (time.process_time() - cpu0) / wall
    # One more request arriving while n-1 streams decode (longer ones, so they are still decoding when it lands).
    arrival = None
    if n > 1:
        firsts = [asyncio.Event() for _ in range(n - 1)]
        background = [asyncio.create_task(_stream(client, model, mode, k, tokens * 4, first=f, extra=extra))
                      for f in firsts]
        for f in firsts:  # every one of them is decoding
            await f.wait()
        arrival = (await _stream(client, model, mode, k, tokens, extra=extra)).ttft_s
        await asyncio.gather(*background)
    await client.close()
    ttfts, tpots = [r.ttft_s for r in results], [r.tpot_s for r in results if r.tpot_s is not None]
    return {"mode": mode, "n": n, "tokens_per_s": sum(r.tokens for r in results) / wall,
            "decode_tokens_per_s": _decode_rate(results), "steady_tokens_per_s": _steady_rate(results),
            "ttft_p50_ms": pct(ttfts, 0.5) * 1e3, "ttft_p95_ms": pct(ttfts, 0.95) * 1e3,
            "tpot_p50_ms": pct(tpots, 0.5) * 1e3, "tpot_p95_ms": pct(tpots, 0.95) * 1e3,
            "idle_ttft_ms": idle * 1e3, "arrival_ttft_ms": arrival * 1e3 if arrival is not None else None,
            "client_cores": client_cores}


def _decode_rate(streams: list[Stream]) -> float:
    """Tokens after each stream's first, over the time from the first stream's first token to the last one's last:
    the aggregate decode rate, without the prompts' queueing and prefill."""
    done = [s for s in streams if s.first_t is not None and s.tokens > 1]
    if not done:
        return float("nan")
    span = max(s.last_t for s in done) - min(s.first_t for s in done)
    return sum(s.tokens - 1 for s in done) / span if span > 0 else float("nan")


def _steady_rate(streams: list[Stream]) -> float:
    """The aggregate decode rate while all N streams decode: from the last stream's first visible chunk to the
    first stream's last, each stream's chunk intervals inside that window over its length. Without the prompts'
    prefills, which the whole-span rate (``_decode_rate``) counts as they interleave with the other streams'
    decode steps; NaN where the streams never all decode at once."""
    if not streams or any(len(s.times) < 2 for s in streams):
        return float("nan")
    start, end = max(s.times[0] for s in streams), min(s.times[-1] for s in streams)
    intervals = sum(max(0, sum(start <= t <= end for t in s.times) - 1) for s in streams)
    return intervals / (end - start) if end > start and intervals else float("nan")


def long_question(words: int) -> str:
    """``QUESTION`` after ``words`` words of a pasted document (none: the question alone): a flood of long prompts
    is priced, chunked and retrieved for differently from one of short questions."""
    if words <= 0:
        return QUESTION
    filler = ("The committee reviewed the quarterly figures, the hiring plan and the office move, and asked for a "
              "written summary of every open item by Friday.").split()
    return " ".join(filler[i % len(filler)] for i in range(words)) + "\n\n" + QUESTION


async def _refusable(client, model: str, mode: str, k: int, tokens: int, question: str, refused: list[float],
                     signals: FloodSignals) -> None:
    """One of tenant A's flood requests; a refusal (429/503) is recorded as its seconds from sending."""
    from openai import APIStatusError

    t0 = time.perf_counter()
    try:
        await _stream(client, model, mode, k, tokens, question)
    except APIStatusError as e:
        if e.status_code not in (429, 503):
            raise
        refused.append(time.perf_counter() - t0)
    finally:
        with signals["ended"].get_lock():
            signals["ended"].value += 1


async def _flood(url: str, model: str, k: int, tokens: int, requests: int, signals: FloodSignals,
                 question: str = QUESTION, mode: str = "text") -> dict:
    """Tenant A sends ``requests`` requests of ``mode`` at once (text: long prompts, ``question`` after k memories);
    then tenant B sends short kv requests, one token."""
    from openai import AsyncOpenAI

    a = AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["bench-a"], max_retries=0, timeout=3600)
    b = AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["bench-b"], max_retries=0, timeout=3600)
    idle = [(await _stream(b, model, "kv", B_K, 1)).ttft_s for _ in range(PROBES)]
    refused: list[float] = []
    flood_tasks = [asyncio.create_task(_refusable(a, model, mode, k, tokens, question, refused, signals))
                   for _ in range(requests)]
    # Every one of A's requests is in the engine (running or queued) or refused before B asks.
    while not signals["go"].is_set():
        await asyncio.sleep(0.005)
    during = [(await _stream(b, model, "kv", B_K, 1)).ttft_s for _ in range(PROBES)]
    signals["probed"].set()
    await asyncio.gather(*flood_tasks)
    await a.close()
    await b.close()
    b_idle, b_flood = statistics.median(idle), statistics.median(during)
    return {"flood_requests": requests, "flood_mode": mode, "flood_tokens": tokens, "flood_k": k,
            "flood_question_chars": len(question), "probes": PROBES,
            "b_idle_ttft_ms": b_idle * 1e3,
            "b_flood_ttft_ms": b_flood * 1e3, "b_flood_ttft_max_ms": max(during) * 1e3,
            "ratio": b_flood / b_idle, "a_refused": len(refused),
            "a_refused_p50_ms": pct(refused, 0.5) * 1e3 if refused else None,
            "a_refused_max_ms": max(refused) * 1e3 if refused else None,
            "a_refused_late_ms": sorted(r * 1e3 for r in refused if r >= LATE_REFUSAL_S)}
