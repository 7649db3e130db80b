"""The engine seam: what the server, the benchmarks and the memory domain need from whatever runs the model.

Two backends implement it: ``inferscale.engine.worker.EngineWorker`` (the project's PyTorch serving loop, one
thread) and ``inferscale.trtllm.backend.TrtllmBackend`` (TensorRT-LLM's LLM API in-process, the InferScale
connector filling the memory pages). ``inferscale serve --engine pytorch|trtllm`` picks one
(``inferscale.contract.ENGINES``; ``open_backend`` in ``inferscale/server/app.py``).

A request is admitted as a ``GenRequest``: its prompt ids (question or chat), the memory blocks to inject and the
mode say the prompt's layout, [shared prefix][block 1 .. block k][question]; its typed events (``TokenEvent`` ...
``DoneEvent`` or ``ErrorEvent``) go to ``req.emit`` from the backend's thread, in order; ``req.cancel()`` stops
it. Memories are encoded by the project's model in every backend (``call``): injected KV must be what InferScale
encoded, whoever serves the question.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from inferscale.engine.engine import Engine
from inferscale.engine.takein import Arrival
from inferscale.engine.steptally import StepKey, StepTotals
from inferscale.engine.loop import DoneEvent, ErrorEvent, Event, GenRequest, TokenEvent

T = TypeVar("T")


class EngineBackend(Protocol):
    engine: Engine  # the project's engine: template, tokenizer, prefix KV, memory encoding
    modes: tuple[str, ...]  # the injection modes this backend serves

    @property
    def alive(self) -> bool: ...

    @property
    def active(self) -> int:
        """Requests being computed now."""

    @property
    def queued(self) -> int:
        """Requests and calls waiting for the engine."""

    @property
    def prompt_token_s(self) -> float | None:
        """Seconds per prompt token as this backend measures them (what the fetch planner weighs recomputing a
        memory by); None before a measurement, or when the backend cannot compute memory tokens behind injected
        ones (``GenRequest.recompute_ids``): then every retrieved block is fetched."""

    @property
    def step_totals(self) -> dict[StepKey, StepTotals]:
        """The serving loop's steps and seconds by (rows decoded, kind) since it started (``steptally.py``); empty
        where another engine's loop runs them (TensorRT-LLM's executor keeps its own iteration stats)."""

    @property
    def kv_usage(self) -> float | None:
        """The share of the K/V budget the running requests hold (INFERSCALE_KV_CACHE_BYTES; vLLM's
        ``kv_cache_usage_perc``); None where another engine keeps its own (TensorRT-LLM's iteration stats)."""

    def check_chars(self, texts: list[str]) -> None:
        """Refuse a prompt too long in characters (``PromptTooLongError``) before any tokenizer sees it."""

    async def prompt_ids(self, turns: list[tuple[str, str]]) -> list[int]:
        """The prompt ids of a chat, tokenized off the engine's thread."""

    def expect(self, tenant: str, prompt_tokens: int = 0, mode: str = "", new_tokens: int = 0) -> Arrival:
        """Announce a request of ``tenant`` in ``mode`` before retrieval (``EngineBusyError`` now when it would
        outwait its queue or its room; ``prompt_tokens``, what is known of its prompt before retrieval: the question's
        tokens, and a text request's memories at the user's mean size; ``new_tokens``, the most it may generate); the
        caller closes the arrival once the request is submitted or given up."""

    def submit(self, req: GenRequest) -> None:
        """Admit ``req``; typed errors (bad mode, foreign block, too long, busy) raise here, before any work."""

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` where the project's model may be used (encoding memories)."""

    def close(self, timeout: float = 5.0) -> None: ...


__all__ = ["DoneEvent", "EngineBackend", "ErrorEvent", "Event", "GenRequest",
           "TokenEvent"]
