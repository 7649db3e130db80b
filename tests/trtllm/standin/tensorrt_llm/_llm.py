"""Stand-in of TensorRT-LLM's LLM API (tests only): ``LLM(model, kv_cache_config=, kv_connector_config=)``,
``generate_async(inputs, sampling_params, streaming=True, cache_salt=) -> RequestOutput`` (async-iterable, one
update per token, ``abort()``), ``shutdown()``; ``SamplingParams`` with the fields the backend sets.

The connector is loaded the way TensorRT-LLM loads it (``importlib.import_module(connector_module)``, the two
classes by name, each built with the ``llm_args``) and driven by ``_executor.StandinExecutor``. The forward pass is
the project's PyTorch model (registered under the model name with ``register_model``) over the pages the connector
filled: one executor thread, requests advanced round-robin a token at a time. None of TensorRT-LLM's code.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import threading
from dataclasses import dataclass, field

import torch

from inferscale.engine.sampling import Sampling, sample
from inferscale.engine.slots import SlotCache
from tensorrt_llm._executor import PagedPool, StandinExecutor, StandinRequest
from tensorrt_llm.inputs.utils import get_cache_salt_id
from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs

_MODELS: dict[str, object] = {}  # model name -> inferscale Engine whose model runs the forward pass


def register_model(name: str, engine) -> None:
    _MODELS[name] = engine


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int | None = None
    ignore_eos: bool = False


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)


class RequestOutput:
    def __init__(self, request_id: int, prompt_token_ids: list[int], loop: asyncio.AbstractEventLoop) -> None:
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.outputs = [CompletionOutput()]
        self.finished = False
        self.aborted = False
        self._loop, self._queue = loop, asyncio.Queue()

    def abort(self) -> None:
        self.aborted = True

    def _push(self, item) -> None:  # executor thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise StopAsyncIteration
        self.outputs = [item]
        self.finished = item.finish_reason is not None
        return self


@dataclass
class _Running:
    req: StandinRequest
    out: RequestOutput
    params: SamplingParams
    slot: int
    length: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    generator: torch.Generator | None = None


class LLM:
    def __init__(self, model: str, *, kv_cache_config: KvCacheConfig | None = None,
                 kv_connector_config: KvCacheConnectorConfig | None = None, max_batch_size: int | None = None,
                 **_: object) -> None:
        self.engine = _MODELS[model]
        self.args = TorchLlmArgs(model=model, kv_cache_config=kv_cache_config or KvCacheConfig(),
                                 kv_connector_config=kv_connector_config, max_batch_size=max_batch_size)
        layout, kv = self.engine.loaded.layout, self.engine.prefix_kv
        pool = PagedPool(1024, kv.shape[0], kv.shape[2], self.args.kv_cache_config.tokens_per_block, kv.shape[4],
                         kv.dtype, kv.device)
        cfg = kv_connector_config
        module = importlib.import_module(cfg.connector_module)
        scheduler = getattr(module, cfg.connector_scheduler_class)(self.args)
        worker = getattr(module, cfg.connector_worker_class)(self.args)
        self.executor = StandinExecutor(scheduler, worker, pool, kv.shape[0])
        self.slots = SlotCache(layout, kv.dtype, kv.device)
        self._ids = itertools.count(1)
        self._new: list[_Running] = []
        self._running: list[_Running] = []
        self._cv = threading.Condition()
        self._stop = False
        self.first_logits: dict[int, torch.Tensor] = {}  # stand-in only: each request's first logits, for tests
        self._thread = threading.Thread(target=self._run, name="trtllm-standin-executor", daemon=True)
        self._thread.start()

    def generate_async(self, inputs: list[int], sampling_params: SamplingParams | None = None, *,
                       streaming: bool = False, cache_salt: str | None = None, **_: object) -> RequestOutput:
        rid = next(self._ids)
        out = RequestOutput(rid, list(inputs), asyncio.get_running_loop())
        req = StandinRequest(rid, list(inputs), cache_salt, get_cache_salt_id(cache_salt) if cache_salt else None)
        with self._cv:
            used = {r.slot for r in self._running + self._new}
            slot = next(s for s in itertools.count() if s not in used)
            self._new.append(_Running(req, out, sampling_params or SamplingParams(), slot))
            self._cv.notify()
        return out

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(5)

    # ---- the executor thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._new and not self._running:
                    self._cv.wait(0.5)
                if self._stop:
                    return
                # first come, first served, at most max_batch_size at once (as TensorRT-LLM's capacity scheduler)
                room = len(self._new) if self.args.max_batch_size is None else self.args.max_batch_size - len(
                    self._running)
                new, self._new = self._new[:max(room, 0)], self._new[max(room, 0):]
            for r in new:
                self._guard(r, self._context)
            for r in list(self._running):
                self._guard(r, self._decode)

    def _guard(self, r: _Running, step) -> None:
        try:
            if r.out.aborted:
                self._end(r)
                return
            step(r)
        except Exception as e:  # noqa: BLE001 - the request's error, as TensorRT-LLM reports one
            if r in self._running:
                self._running.remove(r)
            if r.req.pages:
                self.executor.finish(r.req)
            r.out._push(e)

    @torch.inference_mode()
    def _context(self, r: _Running) -> None:
        self.executor.admit(r.req)
        self._running.append(r)
        start = r.req.held + r.req.matched
        if start:
            self.slots.write(r.slot, self.executor.pool.read(r.req.pages, start))
        logits = self._forward(r.slot, start, r.req.tokens[start:])
        r.length = len(r.req.tokens)
        full = torch.stack([torch.stack((self.slots.keys[i][r.slot, :, :r.length],
                                         self.slots.values[i][r.slot, :, :r.length]))
                            for i in range(len(self.slots.keys))])
        self.executor.pool.write(r.req.pages, full, start, r.length)  # the pages hold the prompt for reuse
        self.first_logits[r.req.request_id] = logits.clone()
        if r.params.seed is not None:
            r.generator = torch.Generator().manual_seed(r.params.seed)
        self._emit(r, logits)

    @torch.inference_mode()
    def _decode(self, r: _Running) -> None:
        logits = self._forward(r.slot, r.length, [r.tokens[-1]])
        r.length += 1
        self._emit(r, logits)

    def _forward(self, slot: int, start: int, ids: list[int]) -> torch.Tensor:
        dev = self.engine.device
        pos = torch.arange(start, start + len(ids))[None]
        out = self.engine.loaded.model(input_ids=torch.tensor([ids], device=dev), position_ids=pos.to(dev),
                                       attention_mask=self.slots.mask([start], len(ids)),
                                       cache=self.slots.view([slot], [start], len(ids)), use_cache=True,
                                       logits_to_keep=1)
        return out.logits[0, -1].float()

    def _emit(self, r: _Running, logits: torch.Tensor) -> None:
        p = r.params
        stops = set(p.stop_token_ids or [])
        banned = stops if len(r.tokens) < (p.min_tokens or 0) else ()
        token = sample(logits, Sampling(max_new_tokens=p.max_tokens, temperature=p.temperature or 0.0,
                                        top_p=p.top_p if p.top_p is not None else 1.0), r.generator, banned)
        reason = None
        if token in stops and not p.ignore_eos:
            reason = "stop"
        else:
            r.tokens.append(token)
        text = self.engine.tokenizer.decode(r.tokens, skip_special_tokens=True)
        for s in p.stop or []:
            at = text.find(s, max(0, len(r.text) - len(s) + 1))
            if at >= 0 and len(r.tokens) >= (p.min_tokens or 0):
                text, reason = text[:at], "stop"
        if reason is None and len(r.tokens) >= p.max_tokens:
            reason = "length"
        diff, r.text = text[len(r.text):], text
        r.out._push(CompletionOutput(0, text, list(r.tokens), reason, diff, [token] if token not in stops else []))
        if reason is not None:
            self._end(r)

    def _end(self, r: _Running) -> None:
        if r in self._running:
            self._running.remove(r)
        self.executor.finish(r.req)
        if r.out.aborted:
            r.out._push(None)

