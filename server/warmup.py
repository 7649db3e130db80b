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
backend's own ``submit``, as tenants' requests do. No tenant's data, store, quota or metric is touched: the requests
carry ``WARMUP_TENANT``, a name no tenant can have (``contract.is_valid_tenant``), and never pass through the HTTP
routes.
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
MEMORY = MemoryItem("warm-up", "The user started talking with the assistant about a trip.")
QUESTION = "What did the user talk about?"
TIMEOUT_S = 120.0  # a warm-up that takes longer is abandoned (logged); the server starts all the same


async def warm_up(backend: EngineBackend, embed_query: Callable[[str, str], object]) -> float:
    """Run every first-request path once; returns the seconds it took. A failure is logged, never raised: a
    warm-up is an optimisation, and a broken engine shows in the liveness probe (``backend.alive``)."""
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(_run_paths(backend, embed_query), TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("warm-up failed (%s: %s); the first requests pay their first-time costs", type(e).__name__, e)
    return time.perf_counter() - t0


async def _run_paths(backend: EngineBackend, embed_query: Callable[[str, str], object]) -> None:
    blocks = await backend.call(lambda engine: engine.encode([MEMORY]))
    await backend.call(lambda _engine: embed_query(QUESTION, WARMUP_TENANT))
    ids = await backend.prompt_ids([("user", QUESTION)])
    for mode in backend.modes:
        if mode not in ("kv", "text"):
            continue
        greedy = mode == "kv"
        sampling = Sampling(max_new_tokens=2, ignore_eos=True, stop=(), temperature=0.0 if greedy else 0.7, seed=0)
        await _generate(backend, ids, blocks, mode, sampling)


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
