"""The K/V the running sequences may hold together, in tokens (``SchedulerConfig.kv_tokens``; a server's
INFERSCALE_KV_CACHE_BYTES).

A request holds its prompt and the most tokens it may generate from the step it is admitted to the step it ends
(TensorRT-LLM's GUARANTEED_NO_EVICT capacity policy): with no preemption, nothing admitted can run out of room
halfway. Without it only ``max_running`` x the model's context bounded the slots' K/V: 64 x 32,768 tokens of
Gemma-3-270M is 77 GB, past the chart's 32 GiB limit, and a pod killed for its memory stops every tenant. Where a
request alone needs more than the whole budget, ``check`` refuses it when it is added. No lock of its own: the
scheduler calls it under its lock.
"""

from __future__ import annotations

from typing import Protocol

from inferscale.errors import PromptTooLongError


class Sized(Protocol):
    id: int
    prompt_tokens: int
    new_tokens: int


def tokens_held(req: Sized) -> int:
    """The K/V tokens ``req`` holds while it runs: its prompt (injected memories included) and what it may
    generate."""
    return req.prompt_tokens + req.new_tokens


class KVBudget:
    def __init__(self, tokens: int | None) -> None:
        self.tokens = tokens  # None: no bound
        self._held: dict[int, int] = {}  # request id -> tokens held

    @property
    def held(self) -> int:
        return sum(self._held.values())

    def room(self) -> int | None:
        """Tokens the budget leaves beside what the running requests hold (None: no bound)."""
        return None if self.tokens is None else self.tokens - self.held

    @property
    def usage(self) -> float | None:
        """The share of the budget the running requests hold (None: no bound)."""
        return None if self.tokens is None else self.held / self.tokens

    def check(self, req: Sized) -> None:
        """PromptTooLongError when ``req`` alone needs more than the whole budget: it could never be admitted."""
        if self.tokens is not None and tokens_held(req) > self.tokens:
            raise PromptTooLongError(f"prompt of {req.prompt_tokens} tokens + {req.new_tokens} to generate: "
                                     f"{tokens_held(req)} tokens of K/V, more than this server holds for all running "
                                     f"requests ({self.tokens}); ask for fewer memories, a shorter prompt or fewer "
                                     f"tokens")

    def fits(self, req: Sized) -> bool:
        return self.tokens is None or self.held + tokens_held(req) <= self.tokens

    def take(self, req: Sized) -> None:
        self._held[req.id] = tokens_held(req)

    def give(self, req: Sized) -> None:
        """``req`` no longer runs (idempotent)."""
        self._held.pop(req.id, None)

    def clear(self) -> None:
        self._held.clear()
