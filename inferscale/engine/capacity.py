"""What the running requests hold together, slots and K/V tokens, and each tenant's part of it.

Slots: ``SchedulerConfig.max_running`` sequences in prefill or decode at once. K/V: ``SchedulerConfig.kv_tokens`` (a
server's INFERSCALE_KV_CACHE_BYTES); a request holds its prompt and the most tokens it may generate from the step
it is admitted to the step it ends (TensorRT-LLM's GUARANTEED_NO_EVICT capacity policy): with no preemption, nothing
admitted can run out of room halfway. Without it only ``max_running`` x the model's context bounded the slots' K/V:
64 x 32,768 tokens of Gemma-3-270M is 77 GB, past the chart's 32 GiB limit, and a pod killed for its memory stops
every tenant. Where a request alone needs more than the whole budget, ``check`` refuses it when it is added.

Shared between tenants (``fits``): with no preemption, a tenant whose requests filled either held up every other
tenant's until its own ended. Measured through ``inferscale serve``: tenant A's six k=20 kv requests of 1,560
tokens each (their memories injected, so held at once) in a 6,340-token budget put tenant B's first token at
2.8-3.0 s against 52 ms idle; A's eight 200-token answers in 8 slots (``INFERSCALE_MAX_ACTIVE``) at 3.2-3.4 s
against 44 ms. So a reserve of each is held back for tenants with nothing running (an eighth of the slots; of the
K/V the server holds back the largest request there can be, the model's context, at most half), and the rest is
split evenly between the tenants with requests running or queued: a tenant may start another request only within
its part of both, its first one whenever the whole holds it. No lock of its own: the scheduler calls it under its
lock.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from inferscale.errors import ConfigError, PromptTooLongError


class Sized(Protocol):
    id: int
    tenant: str
    prompt_tokens: int
    new_tokens: int


R = TypeVar("R", bound=Sized)


def tokens_held(req: Sized) -> int:
    """The K/V tokens ``req`` holds while it runs: its prompt (injected memories included) and what it may
    generate."""
    return req.prompt_tokens + req.new_tokens


def _reserve(total: int | None, reserve: int | None, default_share: int, what: str) -> int:
    """``reserve``, or ``total // default_share`` when None; ConfigError unless it leaves some of ``total``."""
    value = (total or 0) // default_share if reserve is None else reserve
    if total is not None and not 0 <= value < total:
        raise ConfigError(f"reserve of {value} {what}: expected 0 to {total - 1}, less than the {total} there are")
    return value


def _within(amount: int, total: int | None, reserve: int, tenants: int) -> bool:
    """``amount`` fits one of ``tenants``' parts of ``total`` less ``reserve`` (None: no bound)."""
    return total is None or amount <= (total - reserve) // max(tenants, 1)


class Capacity:
    def __init__(self, slots: int | None, tokens: int | None, slot_reserve: int | None = None,
                 token_reserve: int | None = None) -> None:
        """None: no bound; a reserve None: an eighth of the slots, half of the tokens."""
        self.slots, self.tokens = slots, tokens
        self.slot_reserve = _reserve(slots, slot_reserve, 8, "slots")
        self.token_reserve = _reserve(tokens, token_reserve, 2, "K/V tokens")
        self._held: dict[int, tuple[str, int]] = {}  # request id -> (its tenant, K/V tokens held)
        # the same summed, kept as requests come and go: admission asks them for every queue at every step
        self.held = 0  # K/V tokens the running requests hold
        self._tokens: Counter[str] = Counter()  # tenant -> K/V tokens its running requests hold
        self._running: Counter[str] = Counter()  # tenant -> its running requests

    def held_by(self, tenant: str) -> int:
        return self._tokens[tenant]

    def running(self, tenant: str) -> int:
        return self._running[tenant]

    def tenants(self) -> list[str]:
        """The tenants with requests running."""
        return list(self._running)

    def room(self) -> int | None:
        """K/V tokens the budget leaves beside what the running requests hold (None: no bound)."""
        return None if self.tokens is None else self.tokens - self.held

    @property
    def usage(self) -> float | None:
        """The share of the K/V budget the running requests hold (None: no bound)."""
        return None if self.tokens is None else self.held / self.tokens

    def check(self, req: Sized) -> None:
        """PromptTooLongError when ``req`` alone needs more than the whole K/V budget: it could never be admitted."""
        if self.tokens is not None and tokens_held(req) > self.tokens:
            raise PromptTooLongError(f"prompt of {req.prompt_tokens} tokens + {req.new_tokens} to generate: "
                                     f"{tokens_held(req)} tokens of K/V, more than this server holds for all running "
                                     f"requests ({self.tokens}); ask for fewer memories, a shorter prompt or fewer "
                                     f"tokens")

    def fits(self, req: Sized, tenants: int) -> bool:
        """A slot is free and the K/V budget holds ``req`` beside the running requests, within its tenant's part
        (``within_part``)."""
        return ((self.slots is None or len(self._held) < self.slots)
                and (self.tokens is None or self.held + tokens_held(req) <= self.tokens)
                and self.within_part(req, tenants))

    def within_part(self, req: Sized, tenants: int) -> bool:
        """``req``'s tenant runs nothing (its first request may use the reserves), or holds ``req`` too within its part
        of the slots and of the K/V (each less its reserve, split between ``tenants``: those with requests running
        or queued, ``req``'s included)."""
        n = self.running(req.tenant)
        return n == 0 or (_within(n + 1, self.slots, self.slot_reserve, tenants)
                          and _within(self.held_by(req.tenant) + tokens_held(req), self.tokens, self.token_reserve,
                                      tenants))

    def copy(self) -> Capacity:
        """The same capacity holding the same requests: admissions and ends tried on it leave this one as it is."""
        trial = copy.copy(self)
        trial._held, trial._tokens, trial._running = dict(self._held), self._tokens.copy(), self._running.copy()
        return trial

    def room_waits(self, queue: Sequence[R], tenants: int, ends: list[tuple[float, R]],
                   seconds_left: Callable[[R], float]) -> list[float]:
        """Seconds until each of a tenant's queued requests gets room, in order, if the running requests end as
        ``ends`` says: those ahead of it admitted while they fit (each then ending ``seconds_left`` of it later);
        the first that does not, and all behind it (FIFO), wait for the soonest of those ends that makes room for it
        (inf if none does)."""
        trial, ends = self.copy(), list(ends)
        for i, req in enumerate(queue):
            if not trial.fits(req, tenants):
                return [0.0] * i + [trial._give_until_room(req, tenants, ends)] * (len(queue) - i)
            trial.take(req)
            ends.append((seconds_left(req), req))
        return [0.0] * len(queue)

    def _give_until_room(self, req: Sized, tenants: int, ends: Iterable[tuple[float, Sized]]) -> float:
        """Give the running requests back as they end (``ends``: seconds from now, each with its request), the
        soonest first, until ``req`` fits: when it does, inf if never. On a trial copy (``room_waits``'s)."""
        for seconds, running in sorted(ends, key=lambda end: end[0]):
            self.give(running)
            if self.fits(req, tenants):
                return seconds
        return math.inf

    def take(self, req: Sized) -> None:
        self.give(req)  # (taken again: counted once)
        self._held[req.id] = (req.tenant, tokens_held(req))
        self.held += tokens_held(req)
        self._tokens[req.tenant] += tokens_held(req)
        self._running[req.tenant] += 1

    def give(self, req: Sized) -> None:
        """``req`` no longer runs (idempotent)."""
        held = self._held.pop(req.id, None)
        if held is not None:
            tenant, tokens = held
            self.held -= tokens
            self._tokens[tenant] -= tokens
            self._running[tenant] -= 1
            if not self._running[tenant]:
                del self._tokens[tenant], self._running[tenant]

    def clear(self) -> None:
        self._held.clear()
        self._tokens.clear()
        self._running.clear()
        self.held = 0
