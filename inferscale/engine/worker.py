"""The engine worker: one thread owns the model and runs the serving loop; other model calls (encoding memories)
run on it between two steps, so the model is never used from two threads.

Requests are validated and queued from the caller's thread (``submit``: typed errors raise there, before any
model work). Prompts are tokenized off the worker thread too, on a tokenizer copy of their own, after a length
check in characters (a 16 MB message never reaches a tokenizer).

A request's own failure stays with it (the loop's fault boundary). Anything that escapes a step is a bug or an
exhausted device: the worker is then dead for good. At once every queued and running request and every pending
call gets ``EngineUnavailableError`` (503 + Retry-After), later ones too, ``alive`` turns false (liveness fails)
and ``died`` is set, so the process can exit and be restarted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from inferscale.contract import MODES
from inferscale.engine.engine import Engine
from inferscale.engine.loop import ErrorEvent, GenRequest
from inferscale.engine.scheduler import SchedulerConfig
from inferscale.engine.takein import Arrival
from inferscale.engine.slots import FIRST_CAPACITY, FIRST_SLOTS
from inferscale.engine.steptally import StepKey, StepTotals
from inferscale.errors import EngineUnavailableError, PromptTooLongError

log = logging.getLogger(__name__)
T = TypeVar("T")

# No tokenizer we support spends more than this many characters per token on ordinary text; longer prompts are
# refused before tokenization (the exact token check follows it).
CHARS_PER_TOKEN_LIMIT = 16


@dataclass
class _Call:
    fn: Callable[[Engine], object]
    future: concurrent.futures.Future[object] = field(default_factory=concurrent.futures.Future)


class PromptSide:
    """What turning text into prompt ids needs: the template and a tokenizer that only this side uses."""

    question_ids = Engine.question_ids
    chat_ids = Engine.chat_ids

    def __init__(self, engine: Engine) -> None:
        self.template = engine.template
        self.tokenizer = copy.deepcopy(engine.tokenizer)


class EngineWorker:
    """The PyTorch backend of the engine seam (``inferscale.engine.backend.EngineBackend``)."""

    modes = MODES

    def __init__(self, engine: Engine, config: SchedulerConfig | None = None, *, slots: int = FIRST_SLOTS,
                 slot_tokens: int = FIRST_CAPACITY) -> None:
        self.engine = engine
        self.loop = engine.serving_loop(config, slots=slots, slot_tokens=slot_tokens)
        self.max_prompt_chars = engine.loaded.layout.max_positions * CHARS_PER_TOKEN_LIMIT
        self._prompt_side = PromptSide(engine)
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inferscale-tokenize")
        self._calls: deque[_Call] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self.died = threading.Event()  # set once the worker thread failed: this replica must be restarted
        self._thread = threading.Thread(target=self._run, name="inferscale-engine", daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop and not self.died.is_set()

    @property
    def active(self) -> int:
        return self.loop.active

    @property
    def queued(self) -> int:
        return self.loop.queued + len(self._calls)

    @property
    def prompt_token_s(self) -> float | None:
        return self.loop.scheduler.cost.prompt_token_s  # the loop's own measurement (stepcost.py)

    @property
    def step_totals(self) -> dict[StepKey, StepTotals]:
        return self.loop.tally.snapshot()

    @property
    def kv_usage(self) -> float | None:
        return self.loop.scheduler.capacity.usage

    @property
    def rounds(self) -> int:
        return self.loop.steps

    def check_chars(self, texts: list[str]) -> None:
        chars = sum(len(t) for t in texts)
        if chars > self.max_prompt_chars:
            raise PromptTooLongError(f"prompt of {chars} characters exceeds the limit of {self.max_prompt_chars} "
                                     f"(the model's context is {self.engine.loaded.layout.max_positions} tokens)")

    async def prompt_ids(self, turns: list[tuple[str, str]]) -> list[int]:
        """Token ids of a chat (one user turn: the question template, as ``inferscale ask`` uses), after a
        character check; tokenized off the worker thread."""
        self.check_chars([t for _, t in turns])
        side = self._prompt_side
        build = (lambda: side.question_ids(turns[0][1])) if len(turns) == 1 else (lambda: side.chat_ids(turns))
        return await asyncio.wrap_future(self._tokenize_pool.submit(build))

    def expect(self, tenant: str, prompt_tokens: int = 0, mode: str = "", new_tokens: int = 0) -> Arrival:
        """Announce a request of ``tenant`` in ``mode`` before retrieval (``prompt_tokens``: what is known of its
        prompt by then; ``new_tokens``: the most it may generate): EngineBusyError now when it would wait too long."""
        return self.loop.expect(tenant, prompt_tokens, mode, new_tokens)

    def submit(self, req: GenRequest) -> None:
        """Queue a generation; its events go to ``req.emit`` on the worker thread. Typed errors raise here."""
        with self._cv:  # under the lock: a request is either refused here or answered by _abandon
            self._check_running()
            self.loop.add(req)
            self._cv.notify()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the worker thread, between two steps."""
        job = _Call(fn)
        with self._cv:
            self._check_running()
            self._calls.append(job)
            self._cv.notify()
        return await asyncio.wrap_future(job.future)

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)
        self._tokenize_pool.shutdown(wait=False)

    def _check_running(self) -> None:
        if self._stop or self.died.is_set():
            raise self._unavailable()

    def _unavailable(self) -> EngineUnavailableError:
        if self.died.is_set():
            return EngineUnavailableError("the engine worker failed; this replica is restarting, retry later",
                                          retry_after_s=self.loop.scheduler.retry_after_s())
        return EngineUnavailableError("the server is shutting down; retry later")

    # ---- the worker thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:  # noqa: BLE001 - outside every request's boundary: a bug or an exhausted device
            log.critical("the engine worker failed; failing every request and stopping", exc_info=True)
            with self._cv:
                self.died.set()
        self._abandon(self._unavailable())

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._calls and not self.loop.has_work():
                    self._cv.wait(0.5)
                if self._stop:
                    break
                calls = list(self._calls)
                self._calls.clear()
            for job in calls:
                self._run_call(job)
            calls = job = None  # drop references (leased DRAM views) before waiting
            if self.loop.has_work():
                self.loop.step()

    def _run_call(self, job: _Call) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.fn(self.engine))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            job.future.set_exception(e)

    def _abandon(self, err: EngineUnavailableError) -> None:
        """Answer every request the scheduler holds, queued or running, and every pending call with ``err``."""
        with self._cv:  # submit() and call() hold it too: nothing joins after this
            self._stop = True
            requests = self.loop.scheduler.drain()
            calls = list(self._calls)
            self._calls.clear()
        for s in requests:
            try:
                s.payload.emit(ErrorEvent(err))
            except Exception:  # noqa: BLE001 - tell the others all the same
                log.exception("could not report the engine's stop to a request")
        for job in calls:
            if not job.future.done():
                job.future.set_exception(err)
