"""The TensorRT-LLM backend of the engine seam (``inferscale serve --engine trtllm``).

TensorRT-LLM's LLM API runs in this process with the InferScale connector configured
(``KvCacheConnectorConfig``, fields of the pinned release: ``connector_module``, ``connector_scheduler_class``,
``connector_worker_class``). A request in a kv mode becomes the prompt [prefix][block 1 .. block k][question]
plus a plan in the plan directory (prefix KV, the blocks' KV and where each was encoded, the layers' θ), handed
over as ``plans.PlanRegistry`` does; it is submitted with its tenant's ``cache_salt``, so TensorRT-LLM reuses
pages only within a tenant and the connector fills pages only for the plan's tenant. ``text`` mode sends the
same prompt without a plan (TensorRT-LLM prefills the memory tokens); ``none`` sends [prefix][question].

Memories are still encoded by the project's PyTorch model (``call``, one thread). TensorRT-LLM detokenizes and
applies stop strings itself. ``tensorrt_llm`` is imported only when a backend is built; without it the server
fails at start with a ``ConfigError`` naming the package.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from inferscale.engine.engine import Engine
from inferscale.engine.capacity import Capacity
from inferscale.engine.takein import Arrival
from inferscale.engine.loop import DoneEvent, ErrorEvent, GenRequest, TokenEvent
from inferscale.engine.scheduled import ScheduledRequest
from inferscale.engine.spans import request_span
from inferscale.engine.steptally import StepKey, StepTotals
from inferscale.engine.worker import CHARS_PER_TOKEN_LIMIT, EngineWorker, PromptSide
from inferscale.errors import ConfigError, EngineBusyError, InvalidInputError, PromptTooLongError, TransferError
from inferscale.trtllm.core import cache_salt
from inferscale.trtllm.gate import Cancelled, TenantGate
from inferscale.trtllm.plans import InjectionEntry, PlanRegistry, prompt_key

T = TypeVar("T")
PACKAGE = "tensorrt_llm"
MODES = ("kv", "text", "none")  # kv-recompute re-runs memory tokens inside the project's loop: not on TensorRT-LLM
CONNECTOR = {"connector_module": "inferscale.trtllm.connector",
             "connector_scheduler_class": "InferScaleConnectorScheduler",
             "connector_worker_class": "InferScaleConnectorWorker"}


def require_tensorrt_llm() -> None:
    """Fail at start, in one line, where TensorRT-LLM is not installed."""
    if importlib.util.find_spec(PACKAGE) is None:
        raise ConfigError(f"--engine trtllm needs the '{PACKAGE}' package (TensorRT-LLM with its PyTorch backend), "
                          f"which is not importable here: install TensorRT-LLM or serve with --engine pytorch")


@dataclass(frozen=True)
class TrtllmOptions:
    model: str  # what TensorRT-LLM loads (an HF directory or name): the weights the engine encodes memories with
    tokens_per_block: int = 32
    free_gpu_memory_fraction: float = 0.8
    max_in_flight_per_tenant: int = 64  # beyond it a tenant's request is refused (EngineBusyError), not queued
    # the most tokens its KV cache holds (KvCacheConfig.max_tokens; INFERSCALE_KV_CACHE_BYTES): with
    # free_gpu_memory_fraction, TensorRT-LLM sizes the pool at whichever is less; its scheduler admits by free blocks
    max_kv_tokens: int | None = None
    # Of those, held back for tenants with nothing in flight (capacity.py; None: half): TensorRT-LLM's scheduler
    # admits first come, first served, so a tenant past its part of the rest waits in front of it (gate.py)
    kv_reserve_tokens: int | None = None
    # the most requests TensorRT-LLM runs at once (its LlmArgs.max_batch_size; INFERSCALE_MAX_ACTIVE; None: its
    # own default, and no tenant's part of the slots); an eighth of them is held back for tenants with nothing in
    # flight, as the K/V's reserve is, and the rest split between tenants (gate.py)
    max_batch_size: int | None = None
    queue_timeout_s: float = 30.0  # the most a request waits in front of TensorRT-LLM for its tenant's part


class TrtllmBackend:
    modes = MODES

    def __init__(self, engine: Engine, options: TrtllmOptions) -> None:
        require_tensorrt_llm()
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig

        from inferscale.trtllm.connector import PLAN_DIR_ENV, SALT_ID_MODULE

        self.engine, self.options = engine, options
        self._sampling_params = SamplingParams
        self._salt_id = importlib.import_module(SALT_ID_MODULE).get_cache_salt_id  # TensorRT-LLM's salt -> id
        self._plan_dir = Path(tempfile.mkdtemp(prefix="inferscale-plans-", dir=_shared_memory_dir()))
        os.environ[PLAN_DIR_ENV] = str(self._plan_dir)  # TensorRT-LLM's executor processes inherit it
        self.registry = PlanRegistry(self._plan_dir)
        self._secret = os.urandom(32)  # salts live as long as this process's KV pages do
        self.max_prompt_chars = engine.loaded.layout.max_positions * CHARS_PER_TOKEN_LIMIT
        self._prompt_side = PromptSide(engine)
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inferscale-tokenize")
        self._model_calls = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inferscale-engine")
        self._lock = threading.Lock()
        self._plans: Counter[str] = Counter()  # plan key -> requests in flight that use it
        self._tenants: Counter[str] = Counter()
        self._inflight: set[GenRequest] = set()
        # tenants' parts of the slots and the K/V (used on the driver loop only; ``check`` reads fixed sizes)
        self._gate = TenantGate(Capacity(options.max_batch_size, options.max_kv_tokens,
                                         token_reserve=options.kv_reserve_tokens), options.queue_timeout_s)
        self._closed = False
        self._calls = 0
        self.llm = LLM(model=options.model, kv_cache_config=KvCacheConfig(
            enable_block_reuse=True, tokens_per_block=options.tokens_per_block,
            free_gpu_memory_fraction=options.free_gpu_memory_fraction, max_tokens=options.max_kv_tokens),
            kv_connector_config=KvCacheConnectorConfig(**CONNECTOR), max_batch_size=options.max_batch_size)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="inferscale-trtllm", daemon=True)
        self._thread.start()

    # ---- the seam ---------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def active(self) -> int:
        return sum(self._tenants.values())

    @property
    def prompt_token_s(self) -> float | None:
        return None  # its connector fills whole memories from KV: nothing is recomputed, every block is fetched

    @property
    def queued(self) -> int:
        return self._calls + self._gate.waiting  # memory encodings, and requests waiting for their tenant's part

    @property
    def step_totals(self) -> dict[StepKey, StepTotals]:
        return {}  # TensorRT-LLM's executor runs the steps: its iteration stats are its own

    @property
    def kv_usage(self) -> float | None:
        return None  # its KV cache manager's, in its iteration stats

    # The prompt side is the PyTorch worker's: the same character bound, the same template, its own tokenizer.
    check_chars = EngineWorker.check_chars
    prompt_ids = EngineWorker.prompt_ids

    def expect(self, tenant: str, prompt_tokens: int = 0, mode: str = "", new_tokens: int = 0) -> Arrival:
        """TensorRT-LLM queues in its own scheduler: the per-tenant bound is checked at ``submit``."""
        return Arrival(None)

    def submit(self, req: GenRequest) -> None:
        if self._closed:
            raise RuntimeError("engine backend stopped")
        prompt, entry = self._layout(req)
        sized = ScheduledRequest(req.tenant, len(prompt), new_tokens=req.sampling.max_new_tokens)
        self._gate.capacity.check(sized)  # more K/V than the whole budget: it could never start
        with self._lock:
            if self._tenants[req.tenant] >= self.options.max_in_flight_per_tenant:
                raise EngineBusyError(f"tenant {req.tenant!r} has {self._tenants[req.tenant]} requests in flight "
                                      f"on the engine; retry later", retry_after_s=1)
            self._tenants[req.tenant] += 1
            self._inflight.add(req)
        try:
            key = self._hold(prompt, entry) if entry is not None else None
        except BaseException:
            self._release(req, None)
            raise
        salt = cache_salt(self._secret, req.tenant)
        asyncio.run_coroutine_threadsafe(self._drive(req, sized, prompt, key, salt), self._loop)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        if self._closed:
            raise RuntimeError("engine backend stopped")
        self._calls += 1
        try:
            return await asyncio.wrap_future(self._model_calls.submit(fn, self.engine))
        finally:
            self._calls -= 1

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        with self._lock:
            left = list(self._inflight)
        for req in left:  # as the PyTorch worker does: every request in flight hears why it ends
            req.cancel()
            req.emit(ErrorEvent(RuntimeError("server shutting down")))
        self.llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._tokenize_pool.shutdown(wait=False)
        self._model_calls.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self._plan_dir, ignore_errors=True)

    # ---- admission --------------------------------------------------------------------------------------------
    def _layout(self, req: GenRequest) -> tuple[list[int], InjectionEntry | None]:
        """Validate ``req`` and lay out its prompt; the plan for the connector in kv mode."""
        eng = self.engine
        if req.mode not in MODES:
            raise InvalidInputError(f"mode {req.mode!r}: the trtllm engine serves {', '.join(MODES)}", param="mode")
        if not req.ids:
            raise InvalidInputError("empty query", param="messages")
        req.blocks = [] if req.mode == "none" else req.blocks
        for b in req.blocks:
            eng.check_block(b)
        prompt = list(eng.prefix_ids) + [t for b in req.blocks for t in b.token_ids] + list(req.ids)
        limit = eng.loaded.layout.max_positions
        if len(prompt) + req.sampling.max_new_tokens > limit:
            raise PromptTooLongError(f"prompt of {len(prompt)} tokens + {req.sampling.max_new_tokens} to generate "
                                     f"exceeds the model's context of {limit}")
        if req.mode != "kv" or not req.blocks:
            return prompt, None
        dtype = eng.prefix_kv.dtype
        groups = [(list(layers), inv_freq) for layers, inv_freq in eng.loaded.layout.freq_groups().values()]
        return prompt, InjectionEntry(eng.prefix_kv, [b.float_kv(dtype) for b in req.blocks],
                                      [b.start_pos for b in req.blocks], groups,
                                      cache_salt(self._secret, req.tenant))

    def _hold(self, prompt: list[int], entry: InjectionEntry) -> str:
        """Write the plan (once for a tenant's identical prompts in flight); ``_release`` removes it after the
        last. Keyed by the tokens and the salt's id, as the connector looks it up."""
        salt_id = self._salt_id(entry.salt)
        key = prompt_key(prompt, salt_id)
        with self._lock:
            if not self._plans[key]:
                self.registry.put(prompt, entry, salt_id)
            self._plans[key] += 1
        return key

    def _release(self, req: GenRequest, key: str | None) -> None:
        with self._lock:
            self._tenants[req.tenant] -= 1
            self._inflight.discard(req)
            if key is not None:
                self._plans[key] -= 1
                if not self._plans[key]:
                    del self._plans[key]
                    self.registry.discard(key)
        req.blocks = []  # leased DRAM views: drop them now

    def _params(self, req: GenRequest):
        s = req.sampling
        return self._sampling_params(
            max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
            stop=list(s.stops(self.engine.template.default_stop)) or None,
            stop_token_ids=sorted(self.engine.stop_ids), include_stop_str_in_output=False,
            min_tokens=s.min_tokens, ignore_eos=s.ignore_eos)

    # ---- the driver loop (one asyncio loop on its own thread) -------------------------------------------------
    async def _drive(self, req: GenRequest, sized: ScheduledRequest, prompt: list[int], key: str | None,
                     salt: str) -> None:
        """Stream one request's outputs as typed events, once its tenant's part holds it (``sized``, gate.py). Its
        plan is withdrawn before its final event goes out."""
        memory = sum(b.num_tokens for b in req.blocks)
        final: DoneEvent | ErrorEvent | None = None
        span = request_span(req, "prefill", **{"inferscale.mode": req.mode, "inferscale.blocks": len(req.blocks),
                                                    "inferscale.engine": "trtllm"})
        try:
            await self._gate.enter(sized, lambda: req.cancelled)
            out = self.llm.generate_async(prompt, self._params(req), streaming=True, cache_salt=salt)
            seen, first = 0, None
            async for update in out:
                if req.cancelled:
                    out.abort()
                    return
                failure = self.registry.failure(key) if key is not None else None
                if failure is not None:  # the connector zeroed our pages: no answer from unfilled memory
                    out.abort()
                    final = ErrorEvent(TransferError(f"the memory pages of this request could not be filled "
                                                     f"({failure}); retry"))
                    return
                done = update.outputs[0]
                new = list(done.token_ids[seen:])
                seen = len(done.token_ids)
                if first is None and new:
                    first = new[0]
                    span.set_attribute("inferscale.prompt_tokens", len(prompt))
                    span.set_attribute("inferscale.memory_tokens", memory)
                    span.end()
                    span = request_span(req, "decode")
                if new or done.text_diff:
                    req.emit(TokenEvent(new[-1] if new else None, done.text_diff, time.perf_counter()))
                if update.finished:
                    reason = "length" if done.finish_reason == "length" else "stop"
                    final = DoneEvent(reason, len(prompt), memory, seen, first if first is not None else -1)
                    return
            final = ErrorEvent(RuntimeError("TensorRT-LLM ended the request without a final output"))
        except Cancelled:
            return  # cancelled while it waited for its tenant's part: as after an abort, no final event
        except Exception as e:  # noqa: BLE001 - reported to the request, the engine keeps serving
            final = ErrorEvent(e)
        finally:
            if isinstance(final, ErrorEvent):
                span.record_exception(final.error)
            span.end()  # before the client hears of it: its trace is complete when the answer is
            self._gate.leave(sized)  # (idempotent: a request the gate refused holds nothing)
            self._release(req, key)
            if final is not None and not self._closed:
                req.emit(final)


def _shared_memory_dir() -> str | None:
    """A tmpfs both processes see when there is one (plans are written and read once per request)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
