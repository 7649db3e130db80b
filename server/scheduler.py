"""The engine worker: one thread owns the model (and its tokenizer) and schedules at token granularity.

Each round it (1) admits a few queued jobs -- a new request's prefill (its first token is sampled right away) or
a model call such as encoding memories -- and then (2) advances every active sequence by one token. A long
generation therefore never holds up a newer request for more than one round, and the model is never run from two
threads. Results go back to the request's asyncio loop as events:
    ("token", token_id, text_delta, t)   t = time.perf_counter() when it was sampled
    ("done", finish_reason, info)        finish_reason "stop" | "length"; info: prompt/memory/completion tokens
    ("error", exception)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from opentelemetry import trace

from inferscale.contract import DEFAULT_RECOMPUTE_RATIO
from inferscale.engine.engine import Engine, Sampling, Sequence
from inferscale.kvformat import KVBlock

log = logging.getLogger(__name__)


@dataclass
class GenJob:
    build_ids: Callable[[Engine], list[int]]  # tokenizes on the worker thread (the tokenizer is not thread-safe)
    blocks: list[KVBlock]
    mode: str
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO
    tracer: trace.Tracer | None = None
    context: Any = None  # the request span's OTel context
    cancelled: bool = False
    # worker state
    seq: Sequence | None = None
    generator: torch.Generator | None = None
    last: int | None = None
    text: str = ""
    decode_span: Any = None

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's loop is gone
            self.cancelled = True


@dataclass
class CallJob:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: bool = False


class EngineWorker:
    def __init__(self, engine: Engine, *, max_active: int = 64, max_prefills_per_round: int = 4) -> None:
        self.engine = engine
        self.max_active = max_active
        self.max_prefills_per_round = max_prefills_per_round
        self._inbox: deque[GenJob | CallJob] = deque()
        self._cv = threading.Condition()
        self._active: list[GenJob] = []
        self._stop = False
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name="inferscale-engine", daemon=True)
        self._thread.start()

    # ---- API (any thread) ---------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def queued(self) -> int:
        return len(self._inbox)

    def submit(self, job: GenJob | CallJob) -> None:
        with self._cv:
            if self._stop:
                raise RuntimeError("engine worker stopped")
            self._inbox.append(job)
            self._cv.notify()

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` on the worker thread, between two decode rounds."""
        job = CallJob(fn)
        self.submit(job)
        return await asyncio.wrap_future(job.future)

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    # ---- the worker thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._inbox and not self._active:
                    self._cv.wait(0.5)
                if self._stop:
                    break
                admitted = []
                while self._inbox and len(admitted) < self.max_prefills_per_round:
                    if isinstance(self._inbox[0], GenJob) and len(self._active) + len(admitted) >= self.max_active:
                        break
                    admitted.append(self._inbox.popleft())
            for job in admitted:
                if isinstance(job, CallJob):
                    self._run_call(job)
                elif not job.cancelled:
                    self._admit(job)
            # Drop this frame's references before waiting: a finished job's KV blocks are leased views of DRAM
            # arena slots, which stay allocated (even after a purge) while anything still points at them.
            admitted = job = None
            if self._active:
                self._decode_round()
                self.rounds += 1
        for job in [*self._active, *self._inbox]:
            if isinstance(job, GenJob):
                job.emit("error", RuntimeError("server shutting down"))
            elif not job.future.done():
                job.future.set_exception(RuntimeError("server shutting down"))

    def _run_call(self, job: CallJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.fn(self.engine))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            job.future.set_exception(e)

    def _span(self, job: GenJob, name: str, **attrs):
        if job.tracer is None:
            return trace.INVALID_SPAN
        return job.tracer.start_span(name, context=job.context, attributes=attrs)

    def _admit(self, job: GenJob) -> None:
        eng = self.engine
        span = self._span(job, "prefill", **{"inferscale.mode": job.mode, "inferscale.blocks": len(job.blocks)})
        try:
            ids = job.build_ids(eng)
            reserve = job.sampling.max_new_tokens
            job.seq = eng.prefill(ids, job.blocks, job.mode, recompute_ratio=job.recompute_ratio, reserve_tokens=reserve)
            span.set_attribute("inferscale.prompt_tokens", job.seq.prompt_tokens)
            span.set_attribute("inferscale.memory_tokens", job.seq.memory_tokens)
            span.set_attribute("inferscale.query_tokens", len(ids))
            if job.sampling.seed is not None:
                job.generator = torch.Generator().manual_seed(job.sampling.seed)
            token = eng.sample(job.seq.logits, job.sampling, job.generator)
        except Exception as e:  # noqa: BLE001 - reported to the request
            span.record_exception(e)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
            span.end()
            job.emit("error", e)
            return
        span.end()
        job.decode_span = self._span(job, "decode")
        self._advance(job, token, first=True)

    def _decode_round(self) -> None:
        keep: list[GenJob] = []
        for job in self._active:
            if job.cancelled:
                self._finish(job, None)
                continue
            try:
                self.engine.step(job.seq, job.last)
                token = self.engine.sample(job.seq.logits, job.sampling, job.generator)
            except Exception as e:  # noqa: BLE001
                job.emit("error", e)
                self._finish(job, None)
                continue
            if self._advance(job, token, first=False):
                keep.append(job)
        self._active = keep

    def _advance(self, job: GenJob, token: int, *, first: bool) -> bool:
        """Handle a freshly sampled token; True while the sequence stays active."""
        eng, seq = self.engine, job.seq
        if eng.is_stop(token, job.sampling):
            self._finish(job, "stop")
            return False
        now = time.perf_counter()
        produced = [*seq.generated, token]
        text = eng.tokenizer.decode(produced, skip_special_tokens=True)
        delta = ""
        if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
            delta, job.text = text[len(job.text):], text
        job.emit("token", token, delta, now)
        job.last = token
        if len(produced) >= job.sampling.max_new_tokens:
            seq.generated.append(token)  # counted, not fed back
            self._finish(job, "length")
            return False
        if first:
            self._active.append(job)
        return True

    def _finish(self, job: GenJob, reason: str | None) -> None:
        seq = job.seq
        completion = len(seq.generated) if seq is not None else 0
        if job.decode_span is not None:
            job.decode_span.set_attribute("inferscale.completion_tokens", completion)
            job.decode_span.end()
        if reason is not None:
            eng = self.engine
            text = eng.tokenizer.decode(seq.generated, skip_special_tokens=True)
            if text != job.text and text.startswith(job.text):
                job.emit("token", None, text[len(job.text):], time.perf_counter())
            job.emit("done", reason, {"prompt_tokens": seq.prompt_tokens, "memory_tokens": seq.memory_tokens,
                                      "completion_tokens": completion})
        job.seq = None  # free the cache now
