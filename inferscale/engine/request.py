"""A generation request and the events its client receives from the serving loop (``loop.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from inferscale.contract import DEFAULT_RECOMPUTE_RATIO
from inferscale.engine.detokenize import AnswerText
from inferscale.engine.sampling import Sampling
from inferscale.engine.scheduled import ScheduledRequest
from inferscale.kvformat import KVBlock

if TYPE_CHECKING:  # the engine imports no OpenTelemetry at run time: the server hands its tracer in
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer

    from inferscale.engine.spans import RequestSpan


# ---- events: what a request's client receives ------------------------------------------------------------------
@dataclass(frozen=True)
class TokenEvent:
    token_id: int | None  # None: a final text flush with no new token
    text: str  # the new visible text (may be "" while a multi-byte character is incomplete)
    t: float  # time.perf_counter() when the token was sampled


@dataclass(frozen=True)
class DoneEvent:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    memory_tokens: int
    completion_tokens: int
    first_token: int  # the first token chosen, a stop token included (what agreement between modes compares)


@dataclass(frozen=True)
class ErrorEvent:
    error: BaseException


Event = TokenEvent | DoneEvent | ErrorEvent


@dataclass(eq=False)
class GenRequest:
    """A generation request: prompt ids (question or chat, already tokenized), the blocks to inject, and where its
    events go. ``emit`` is called on the loop's thread."""

    ids: list[int]
    blocks: list[KVBlock]
    mode: str
    sampling: Sampling
    emit: Callable[[Event], None]
    tenant: str = "default"
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO
    tracer: Tracer | None = None  # the server's tracer: the prefill and decode spans are children of its span
    context: Context | None = None  # the request span's context
    keep_first_logits: bool = False  # keep the first token's logits in ``first_logits`` (benchmarks compare them)
    # kv mode: memory tokens computed in the prompt pass, after the injected blocks and before ``ids`` (the memories
    # the fetch planner chose to recompute rather than fetch: their text-mode tokens, inferscale/store/fetcher.py)
    recompute_ids: list[int] = field(default_factory=list)
    # loop state
    sched: ScheduledRequest | None = None
    slot: int = -1
    length: int = 0  # tokens in the slot
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet computed
    slot_filled: bool = True  # the prefix (and kv blocks) are in its slot: at admission False (ServingLoop._fill)
    output: list[int] = field(default_factory=list)  # generated tokens, stop token excluded
    last: int | None = None  # the token the next decode step feeds
    first_token: int | None = None
    first_logits: torch.Tensor | None = None  # [vocab] float32 on the CPU, with keep_first_logits
    answer_text: AnswerText | None = None  # ``output`` decoded so far, token by token (set at admission)
    sent: int = 0  # characters of that text already emitted (the rest may be the start of a stop sequence)
    stops: tuple[str, ...] = ()  # the stop sequences in force (resolved by ServingLoop.add)
    stop_floor: int = 0  # a stop sequence may begin no earlier (text said before min_tokens was reached)
    answer: str | None = None  # the final text when a stop sequence ended it
    generator: torch.Generator | None = None
    span: RequestSpan | None = None  # the phase in progress (prefill, decode)
    ended: bool = False  # its DoneEvent or ErrorEvent was emitted: nothing more is

    cancelled: bool = False  # set by cancel(); a backend without a ScheduledRequest polls it

    @property
    def memory_tokens(self) -> int:
        """Memory tokens in the prompt: injected and recomputed."""
        return sum(b.num_tokens for b in self.blocks) + len(self.recompute_ids)

    def cancel(self) -> None:
        self.cancelled = True
        if self.sched is not None:
            self.sched.cancelled = True
