"""The scheduler's vocabulary: what it knows of a request, and what one step runs (scheduler.py).

No model, no tokenizer, no torch: tests build them with made-up token counts.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class ScheduledRequest:
    """What the scheduler knows of a request: its tenant and its token counts."""

    tenant: str
    prompt_tokens: int  # all tokens before the first generated one (prefix + memories + question)
    computed_tokens: int = 0  # already in the cache (the injected prefix and blocks count from the start)
    new_tokens: int = 0  # the most it may generate: with its prompt, the K/V it holds while it runs (capacity.py)
    payload: Any = None  # the engine's own request object; the scheduler never looks inside
    arrived: float = field(default_factory=time.monotonic)
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: bool = False
    generated: int = 0  # tokens generated so far (the serving loop counts them): when it may end (stepcost.py)
    mode: str = ""  # what its prompt is made of (an opaque label here): a tenant's typical prompt is kept by mode
    kept: bool = False  # a step's shedding kept it once: from then on its predicted wait may reach the queue timeout

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_tokens - self.computed_tokens


def retry_after_s(queue_timeout_s: float) -> int:
    """The Retry-After of a request refused for waiting (or being about to wait) out the queue timeout."""
    return max(1, round(queue_timeout_s / 4))


@dataclass
class SchedulerOutput:
    decode: list[ScheduledRequest]  # advance one token each, in one batched pass
    prefill: list[tuple[ScheduledRequest, int]]  # (request, number of prompt tokens to compute now)
    admitted: list[ScheduledRequest]  # newly given a slot this step (filled before its first prompt pass)
    expired: list[ScheduledRequest]  # waited longer than the queue timeout; never ran
    cancelled: list[ScheduledRequest]  # cancelled by the client; the engine frees what they hold
    # queued, but at the costs measured since they were accepted they would outwait the queue timeout: refused now
    shed: list[ScheduledRequest] = field(default_factory=list)
    pass_tokens: int | None = None  # the most padded prompt tokens one of the step's passes computes
