"""The K/V the running sequences may hold together, in tokens (``SchedulerConfig.kv_tokens``; a server's
INFERSCALE_KV_CACHE_BYTES).

A request holds its prompt and the most tokens it may generate from the step it is admitted to the step it ends
(TensorRT-LLM's GUARANTEED_NO_EVICT capacity policy): with no preemption, nothing admitted can run out of room
halfway. Without it only ``max_running`` x the model's context bounded the slots' K/V: 64 x 32,768 tokens of
Gemma-3-270M is 77 GB, past the chart's 32 GiB limit, and a pod killed for its memory stops every tenant. Where a
request alone needs more than the whole budget, ``check`` refuses it when it is added.

Shared between tenants (``fits``): without preemption, a tenant whose requests filled the budget held up every other
tenant's until its own ended. Measured through ``inferscale serve`` (a 6,340-token budget, tenant A's six k=20 kv
requests of 1,560 tokens each, their memories injected, so they held it at once): tenant B's first token came after
2.8-3.0 s against 52 ms idle. So ``reserve`` tokens are held back for tenants with nothing running (the server holds
back the largest request there can be, the model's context, at most half the budget), and the rest is split evenly
between the tenants with requests running or queued: a tenant may start another request only within its part, its
first one whenever the whole budget holds it (B then 1.1-1.5x idle). No lock of its own: the scheduler calls it
under its lock.
"""

from __future__ import annotations

from typing import Protocol

from inferscale.errors import ConfigError, PromptTooLongError


class Sized(Protocol):
    id: int
    tenant: str
    prompt_tokens: int
    new_tokens: int


def tokens_held(req: Sized) -> int:
    """The K/V tokens ``req`` holds while it runs: its prompt (injected memories included) and what it may
    generate."""
    return req.prompt_tokens + req.new_tokens


class KVBudget:
    def __init__(self, tokens: int | None, reserve: int | None = None) -> None:
        """``reserve`` None: half of ``tokens``."""
        self.tokens = tokens  # None: no bound
        # held back for tenants with nothing running (their first request)
        self.reserve = (tokens or 0) // 2 if reserve is None else reserve
        if tokens is not None and not 0 <= self.reserve < tokens:
            raise ConfigError(f"K/V reserve of {self.reserve} tokens: expected 0 to {tokens - 1}, less than the "
                              f"budget of {tokens}")
        self._held: dict[int, tuple[str, int]] = {}  # request id -> (its tenant, tokens held)

    @property
    def held(self) -> int:
        return sum(n for _, n in self._held.values())

    def held_by(self, tenant: str) -> int:
        return sum(n for t, n in self._held.values() if t == tenant)

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

    def fits(self, req: Sized, tenants: int = 1) -> bool:
        """The budget holds ``req`` beside the running requests, within its tenant's part (``within_part``)."""
        return self.tokens is None or (self.held + tokens_held(req) <= self.tokens and self.within_part(req, tenants))

    def part(self, tenants: int) -> int | None:
        """What each of ``tenants`` may hold: the budget less ``reserve``, split evenly (None: no bound)."""
        return None if self.tokens is None else (self.tokens - self.reserve) // max(tenants, 1)

    def within_part(self, req: Sized, tenants: int) -> bool:
        """``req``'s tenant runs nothing (its first request may use the reserve), or holds ``req`` too within its
        ``part`` of ``tenants`` (those with requests running or queued, ``req``'s included)."""
        part, own = self.part(tenants), self.held_by(req.tenant)
        return part is None or own == 0 or own + tokens_held(req) <= part

    def take(self, req: Sized) -> None:
        self._held[req.id] = (req.tenant, tokens_held(req))

    def give(self, req: Sized) -> None:
        """``req`` no longer runs (idempotent)."""
        self._held.pop(req.id, None)

    def clear(self) -> None:
        self._held.clear()
