"""Warm-up before the server listens: each path a first request takes, run once on a memory of its own (issue 22).

A fresh process pays first-time costs on its first requests: kernels loaded lazily (the KV rotation at the first
injection), the slot pool's and a pass's first allocations, the query embedder's first pass, the sampler's first
logits, the cost model's first measurement. On the 2-core Zen 4 machine a restarted server's first kv request spent
12-20 ms in retrieval and 50-70 ms in its prefill against 5-9 and 24-32 once warm (docs/bench/HISTORY.md, "warm
before listening"); a pod that says it is ready should not hand that to the first user behind the load balancer. (Its
first fetch of each user's blocks from disk is that user's data: not warmed here.) So before the app starts listening
(its lifespan, where the model was loaded too) one memory of no tenant is encoded (never stored), the question is
embedded on the engine's thread (where an idle server embeds: ``MemoryService._on_idle_cores``), and a kv request
with it (greedy: the LM head's screen) and a text request (sampled: the full head and the sampler) run through the
backend's own ``submit``, as tenants' requests do. Then a burst of kv requests, one for each slot, decodes a few tokens
together: the cost model's price of a many-row pass (``StepCost.decode_row_s``), which admission prices a full
batch's waits for room by, is measured before the first tenant's burst, not learnt from that burst's own small passes.
Without it a fresh server's first 64-request burst (`bench load --hold`, 2-core Zen 4) was priced from the warm-up's
one-row passes and then its 11-42-row ones (a 56-row pass read 38-110 ms as they came in, against ~80-95 measured),
and the 8 requests past the tenant's part were kept on arrival and refused 1.2-7.4 s later in 7 of 11 first bursts.
No tenant's data, store, quota or metric is touched: the requests carry ``WARMUP_TENANT``, a name no tenant can have
(``contract.is_valid_tenant``), and never pass through the HTTP routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from inferscale.engine.backend import DoneEvent, EngineBackend, ErrorEvent, Event, GenRequest
from inferscale.engine.sampling import Sampling
from inferscale.engine.template import MemoryItem
from inferscale.kvformat import KVBlock

log = logging.getLogger(__name__)

WARMUP_TENANT = "(warm-up)"  # not a valid tenant name: no tenant's accounting or queue is ever this one's
# About a typical memory's length (~30 tokens: a LoCoMo observation with its date): the burst's rows hold ``k`` of it.
MEMORY = MemoryItem("warm-up", "On the first Saturday of May the user started talking with the assistant about a trip "
                               "to the coast with two old friends and their dog.")
QUESTION = "What did the user talk about?"
TIMEOUT_S = 120.0  # a warm-up that takes longer is abandoned (logged); the server starts all the same
# Tokens each request of the many-row burst generates: its requests are admitted over several steps (their prompt
# passes), so every row decodes together only for the last few of them.
BURST_TOKENS = 12


async def warm_up(backend: EngineBackend, embed_query: Callable[[str, str], object], rows: int = 1,
                  k: int = 1) -> float:
    """Run every first-request path once, and a burst of ``rows`` kv requests (the server's slots) each holding the
    memory ``k`` times (the server's default k: a decode row's cost grows with the keys it reads); returns the
    seconds it took. A failure is logged, never raised: a warm-up is an optimisation, and a broken engine shows in
    the liveness probe (``backend.alive``)."""
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(_run_paths(backend, embed_query, rows, k), TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("warm-up failed (%s: %s); the first requests pay their first-time costs", type(e).__name__, e)
    return time.perf_counter() - t0


async def _run_paths(backend: EngineBackend, embed_query: Callable[[str, str], object], rows: int, k: int) -> None:
    blocks = await backend.call(lambda engine: engine.encode([MEMORY]))
    await backend.call(lambda _engine: embed_query(QUESTION, WARMUP_TENANT))
    ids = await backend.prompt_ids([("user", QUESTION)])
    for mode in backend.modes:
        if mode not in ("kv", "text"):
            continue
        greedy = mode == "kv"
        sampling = Sampling(max_new_tokens=2, ignore_eos=True, stop=(), temperature=0.0 if greedy else 0.7, seed=0)
        await _generate(backend, ids, blocks, mode, sampling)
    if rows > 1 and "kv" in backend.modes:
        burst = Sampling(max_new_tokens=BURST_TOKENS, ignore_eos=True, stop=(), temperature=0.0, seed=0)
        await asyncio.gather(*(_generate(backend, ids, blocks * max(k, 1), "kv", burst) for _ in range(rows)))
        # the step that answered the last of them ends (its pass measured) before the app freezes its heap
        # (gcheap.py): one such step read an 8-row pass at 339 ms against ~15 (a collection or rows moving: not told
        # apart; moves are now left out of a pass's time, slots.py ``aside_s``)
        await backend.call(lambda _engine: None)


async def _generate(backend: EngineBackend, ids: list[int], blocks: list[KVBlock], mode: str,
                    sampling: Sampling) -> None:
    """Submit one request of ``WARMUP_TENANT`` and wait for its last event (emitted on the backend's thread)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Event] = loop.create_future()

    def emit(event: Event) -> None:
        if isinstance(event, (DoneEvent, ErrorEvent)):
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(event))

    backend.submit(GenRequest(ids=list(ids), blocks=blocks, mode=mode, sampling=sampling, emit=emit,
                              tenant=WARMUP_TENANT))
    last = await done
    if isinstance(last, ErrorEvent):
        raise last.error
