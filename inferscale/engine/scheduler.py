"""The scheduler: which requests run in the next step, and how many prompt tokens each may compute.

No model, no tokenizer, no torch (tests drive it with made-up outputs). vLLM v1's shape: a request has computed vs
total prompt tokens; injected memory tokens count as computed from the start; one token budget per step pays one
token per running decode, and what is left goes to prompt chunks. Fairness between tenants (issue 12):
  - each tenant has its own bounded FIFO queue; a request that waits longer than ``queue_timeout_s`` for a slot
    expires (the server answers 503 + Retry-After);
  - prompt chunks are handed out round-robin over tenants, one chunk of at most ``chunk_tokens`` per turn, so a
    tenant flooding long ``text`` prompts gets one turn per round like everyone else, at every step; the tenant
    served longest ago (a newcomer) takes the first turn;
  - a tenant continues its started prompts (oldest first) before it starts another, which keeps half-computed
    slots to what one step's budget can hold.
Time, not only tokens (issue 22): a step's prompt budget is also bounded by ``step_time_s`` at the measured cost
of a prompt token and a decode pass (stepcost.py), so a request arriving during a flood waits at most one short
step (half of ``step_time_s`` while it is announced and fetching its memories) before its own prompt runs first;
and ``expect`` (before retrieval) and ``add`` refuse a request whose predicted wait, for prompts ahead or for room,
passes its margin of the queue timeout (EngineBusyError: 503 + Retry-After), not after waiting it out. A newcomer
whose question fits one pass is handed to the serving loop between two of the pass in progress's layers
(``take_newcomer``, interject.py). A queued request the costs measured since would make outwait the timeout is
refused at the next step (``shed``). Room: a slot, and the K/V budget for the request's prompt + the most it may
generate, within its tenant's part of both (capacity.py), or it waits. Thread-safe: ``add`` and ``cancel``
from any thread, ``schedule``/``finish``/``take_newcomer`` from the engine thread.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from inferscale.engine.capacity import Capacity
from inferscale.engine.scheduled import ScheduledRequest, SchedulerOutput, retry_after_s
from inferscale.engine.stepcost import StepCost, ewma
from inferscale.engine.takein import Arrival, TakeIn
from inferscale.errors import ConfigError, EngineBusyError

# Refuse once the predicted wait reaches this fraction of the queue timeout: the prediction leaves out the decode
# rows the requests ahead add once their prompts are done, and their tokens' streaming. ``bench load --flood``, 2-core
# CPU (takein.py): at 0.8, up to 17 of 32 kept and one shed 6-7 s in (2 repeats of 6); at 0.7 none later than 0.44 s.
SHED_AT = 0.7
# The same while the tenant's own prompts were not measured (``StepCost.tenant_token_s``): its wait is priced at other
# tenants' costs. A first flood's ~2,300-token text prompts (``--flood-words 1500``) cost 1.4-2.8x a token of another
# tenant's short questions: at 0.8, one burst in three kept requests it shed 1.6-2.7 s in, once A's passes were timed.
SHED_AT_UNMEASURED = 0.5
# While a tenant with no prompt started is on its way, steps are bounded to this share of ``step_time_s``: it
# arrives during one of them and waits that one out before its own prompt runs first.
NEWCOMER_STEP_SHARE = 0.35
# The most prompt tokens the serving loop lets a timed pass hold where the model's fast kernels take more
# (``LoadedModel.pass_rows``: 128 on AVX512-BF16): a newcomer not run between its layers (interject.py) waits out
# the pass in progress. 2-core Zen 4, 2026-12-04, ``bench load --flood`` (3 repeats): passes of up to 128 tokens
# gave tenant B 2.46x [2.32, 2.55] its idle TTFT, of up to 64 1.43x [1.34, 1.98] (next run 1.63x [1.52, 1.71]).
NEWCOMER_PASS_TOKENS = 64


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 64  # slots: sequences in prefill or decode at once
    running_reserve: int | None = None  # of those, held back for tenants with none (capacity.py); None: an eighth
    # Token budget per step (decode tokens + prompt chunk tokens). It bounds how long a step runs, which is what a
    # newly arrived request waits before its own prompt runs (at most one step).
    step_tokens: int = 512
    chunk_tokens: int = 128  # the most prompt tokens one request computes per turn
    max_queued_per_tenant: int = 64
    queue_timeout_s: float = 30.0
    # A step's target wall time: its prompt tokens are cut to what fits beside its decode pass (at least
    # ``min_chunk_tokens``, so prompts always progress). What a request arriving mid-step waits for.
    step_time_s: float = 0.25
    # The most prompt tokens a timed pass holds (None: no limit): the rows the model's decode-path products take
    # (``LoadedModel.pass_rows``), at most ``NEWCOMER_PASS_TOKENS`` (the serving loop sets it). Past them a pass
    # changes kernel and cost per token: in a flood, passes of 66-74 tokens took 118-140 ms against 87 ms meant.
    max_pass_tokens: int | None = None
    # The K/V tokens the running requests may hold together, each at its prompt + the most it may generate
    # (capacity.py); None: only ``max_running`` x the model's context bounds them.
    kv_tokens: int | None = None
    # Of those, held back for tenants with nothing running (capacity.py); None: half of ``kv_tokens``.
    kv_reserve_tokens: int | None = None

    @property
    def min_chunk_tokens(self) -> int:
        """The fewest prompt tokens a step or a pass is cut to (so prompts always progress), and the smallest
        chunk a prompt starts with short of its whole length (a sliver would be a pass of its own)."""
        return max(self.chunk_tokens // 4, 1)

    def __post_init__(self) -> None:
        for name in ("max_running", "step_tokens", "chunk_tokens", "max_queued_per_tenant", "kv_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"scheduler {name}={getattr(self, name)}: expected 1 or more")
        for name in ("queue_timeout_s", "step_time_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"scheduler {name}={getattr(self, name)}: expected > 0")


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None, *, clock=time.monotonic) -> None:
        self.config = config or SchedulerConfig()
        self.clock = clock
        self._lock = threading.Lock()
        self._waiting: dict[str, deque[ScheduledRequest]] = {}  # tenant -> its FIFO queue
        self._prefilling: dict[str, list[ScheduledRequest]] = {}  # tenant -> its started prefills, oldest first
        self._decoding: list[ScheduledRequest] = []
        self._served_at: dict[str, int] = {}  # tenant -> the step it last computed a prompt chunk
        self._steps = 0
        self.cost = StepCost()  # the loop reports what its steps took
        self._arriving: dict[str, list[ScheduledRequest]] = {}  # announced (``expect``), not added yet
        # (tenant, mode) -> moving average of its prompts' tokens to compute (kept by tenant alone, a tenant's kv
        self._typical_prompt: dict[tuple[str, str], float] = {}  # questions after its text flood counted ~2,000 each)
        self._take_in = TakeIn(clock)
        c = self.config  # what the running requests hold, slots and K/V: admission waits for room
        self.capacity = Capacity(c.max_running, c.kv_tokens, c.running_reserve, c.kv_reserve_tokens)

    # ---- any thread -----------------------------------------------------------------------------------------
    def add(self, req: ScheduledRequest) -> None:
        """Queue ``req``; EngineBusyError when its tenant's queue is full or its predicted wait for a slot exceeds
        the queue timeout; PromptTooLongError when it alone needs more K/V than the budget holds."""
        with self._lock:
            self.capacity.check(req)
            queue = self._waiting.get(req.tenant, ())
            if len(queue) >= self.config.max_queued_per_tenant:
                raise EngineBusyError(f"tenant {req.tenant!r} has {len(queue)} requests queued (limit "
                                      f"{self.config.max_queued_per_tenant}); retry later",
                                      retry_after_s=self.retry_after_s())
            # Its own size first: in a tenant's first burst the requests still arriving count at its size, not none.
            key = req.tenant, req.mode
            self._typical_prompt[key] = ewma(self._typical_prompt.get(key), req.remaining_prompt)
            self._refuse_a_long_wait(req.tenant)
            req.arrived = self.clock()
            self._waiting.setdefault(req.tenant, deque()).append(req)

    def expect(self, tenant: str, prompt_tokens: int = 0, mode: str = "", new_tokens: int = 0) -> Arrival:
        """A request of ``tenant`` is on its way (retrieval and KV fetch come before ``add``): EngineBusyError now
        when its wait would pass its margin of the timeout, before any work is spent on it: for the prompts ahead, and
        for room (``new_tokens``: the most it may generate). Until closed (just before ``add``, or when the request
        fails) the arrival counts in every prediction at its ``mode``'s typical prompt or at ``prompt_tokens`` (the
        question's, and a text request's memories at the user's mean size), the larger: a burst is refused on
        arrival, not after its retrievals (32 ~2,000-token prompts announced at nothing were refused 0.7-1.1 s later,
        once added; a hold burst's last were refused 0.5-0.8 s in, at the first look after retrieval)."""
        req = ScheduledRequest(tenant, prompt_tokens, new_tokens=new_tokens, mode=mode, arrived=self.clock())
        with self._lock:
            self._refuse_a_long_wait(tenant, self._room_wait(req))
            self._take_in.spend(bool(self._arriving))
            self._arriving.setdefault(tenant, []).append(req)
        return Arrival(self, req)

    def arrived(self, req: ScheduledRequest) -> None:
        """An announced request was added or gave up (``Arrival.close``)."""
        with self._lock:
            self._take_in.spend(bool(self._arriving))
            arriving = self._arriving.get(req.tenant, [])
            if req in arriving:
                arriving.remove(req)
            if not arriving:
                self._arriving.pop(req.tenant, None)

    def taking_in(self) -> bool:
        """Announced requests are being taken in (``expect``, not added yet), at most TAKE_IN_S in a row (takein.py):
        passes run now share the cores with their work, and may lower the cost estimates, not raise them."""
        with self._lock:
            return self._take_in.spend(bool(self._arriving))

    def cancel(self, req: ScheduledRequest) -> None:
        with self._lock:
            req.cancelled = True

    def retry_after_s(self) -> int:
        return retry_after_s(self.config.queue_timeout_s)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def num_running(self) -> int:
        return len(self._decoding) + sum(len(started) for started in self._prefilling.values())

    def has_work(self) -> bool:
        return bool(self.num_waiting or self._prefilling or self._decoding)

    # ---- engine thread --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        with self._lock:
            cancelled = self._drop_cancelled()
            expired = self._expire()
            shed = self._shed()
            decode = list(self._decoding)
            lone = self._lone()
            budget = self._prompt_budget(len(decode), self._newcomer_on_its_way(), lone)
            pass_tokens = self._pass_tokens()
            chunk_tokens = self._chunk_tokens(lone, pass_tokens)
            admitted: list[ScheduledRequest] = []
            prefill: list[tuple[ScheduledRequest, int]] = []
            # Rounds of turns until the budget is spent: in each round every tenant with prompt work computes one
            # chunk of one request (its oldest started one, else its next queued one); a request gets one chunk per
            # step. The tenant served longest ago goes first (a newcomer first of all).
            self._steps += 1
            # Among tenants served as recently, the shorter next prompt first: a waiting tenant's short question
            # is not queued behind another's long prompt for a step because both had a turn in the last one.
            order = sorted(self._waiting, key=lambda t: (self._served_at.get(t, -1), self._next_prompt(t)))
            chunked: set[int] = set()
            served: set[str] = set()
            unfinished: set[str] = set()  # tenants with a prompt still unfinished after this step's chunks
            progress = True
            while budget > 0 and progress:
                progress = False
                for tenant in order:
                    if budget <= 0:
                        break
                    req = next((r for r in self._prefilling.get(tenant, ()) if r.id not in chunked), None)
                    queue = self._waiting.get(tenant)
                    if req is None and (not queue or tenant in unfinished or not self._room_for(queue[0])):
                        continue  # (a tenant's started prompt goes on before another starts; FIFO: its next waits)
                    if budget < min((req or queue[0]).remaining_prompt, self.config.min_chunk_tokens):
                        continue  # a sliver of a prompt would be a forward pass of its own for a few tokens
                    if req is None:
                        req = queue.popleft()
                        self._prefilling.setdefault(tenant, []).append(req)
                        self.capacity.take(req)
                        admitted.append(req)
                    chunked.add(req.id)
                    n = min(req.remaining_prompt, chunk_tokens, budget)
                    if lone and 0 < req.remaining_prompt - n < self.config.min_chunk_tokens <= budget - n:
                        # the tail would be a forward pass of its own for a few tokens (measured: a 35-token
                        # question cut into 32 + 3 paid two passes, ~70 ms more to its first token); only while
                        # no other tenant waits: then a step's time bound comes first
                        n = req.remaining_prompt
                    if n > 0:
                        prefill.append((req, n))
                        budget -= n
                        progress = True
                    if n < req.remaining_prompt:
                        unfinished.add(tenant)
                    served.add(tenant)
            for tenant in served:
                self._served_at[tenant] = self._steps
            for tenant in [t for t, q in self._waiting.items() if not q and t not in self._prefilling]:
                del self._waiting[tenant]
                self._served_at.pop(tenant, None)
            return SchedulerOutput(decode=decode, prefill=prefill, admitted=admitted, expired=expired,
                                   cancelled=cancelled, shed=shed, pass_tokens=pass_tokens)

    def computed(self, req: ScheduledRequest, tokens: int) -> None:
        """The engine computed ``tokens`` more prompt tokens of ``req``; once all are, it decodes."""
        with self._lock:
            req.computed_tokens += tokens
            started = self._prefilling.get(req.tenant, [])
            if req.remaining_prompt <= 0 and req in started:
                started.remove(req)
                if not started:
                    del self._prefilling[req.tenant]
                self._decoding.append(req)

    def finish(self, req: ScheduledRequest) -> None:
        """``req`` is done (stopped, failed or cancelled): it leaves every list."""
        with self._lock:
            if not req.cancelled and req.generated:  # an answer's length (a cancelled one says nothing of it)
                self.cost.observe_answer(req.tenant, req.generated, req.new_tokens)
            self._remove(req)

    def drain(self) -> list[ScheduledRequest]:
        """Every request held, running or queued, oldest first by list; the scheduler is left empty (the engine
        stops: each gets an error)."""
        with self._lock:
            held = [*self._decoding, *itertools.chain(*self._prefilling.values(), *self._waiting.values())]
            self._decoding.clear()
            self._prefilling.clear()
            self._waiting.clear()
            self.capacity.clear()
            return held

    def take_newcomer(self, busy: set[str], fits: Callable[[ScheduledRequest], bool]) -> ScheduledRequest | None:
        """The next queued request of a tenant not in ``busy`` and with no prompt started, if ``fits`` takes it,
        admitted now as its tenant's turn (interject.py runs its prompt between two layers of a pass computing for
        ``busy``); None when there is none or no room (a slot, K/V) for it."""
        with self._lock:
            for tenant, queue in self._waiting.items():
                if (tenant in busy or tenant in self._prefilling or not queue or queue[0].cancelled
                        or not self._room_for(queue[0]) or not fits(queue[0])):
                    continue
                req = queue.popleft()
                self._prefilling[tenant] = [req]
                self.capacity.take(req)
                self._served_at[tenant] = self._steps
                return req
            return None

    def shed_queued(self) -> list[ScheduledRequest]:
        """What ``schedule`` refuses as ``shed``, now: the loop asks between the passes of a long step, so a request
        accepted on a guess is refused within a pass, not after the step."""
        with self._lock:
            return self._shed()

    def interrupted(self, tenants: set[str]) -> bool:
        """A tenant not among ``tenants`` (those the step's remaining prompt passes compute for) is announced or
        queued: those passes wait for the next step, in which it has the first turn."""
        with self._lock:
            return any(t not in tenants for t in self._arriving) or any(
                q and t not in tenants for t, q in self._waiting.items())

    # ---- internals (lock held) ------------------------------------------------------------------------------
    def _room_for(self, req: ScheduledRequest) -> bool:
        """A slot is free and the K/V budget holds ``req`` beside the running requests, within its tenant's part."""
        return self.capacity.fits(req, self._tenants(req))

    def _tenants(self, req: ScheduledRequest) -> int:
        """Tenants with requests running or queued, ``req``'s included: how many share the capacity."""
        return len({req.tenant, *self._prompt_tenants(), *(r.tenant for r in self._decoding)})

    def _running_ends(self) -> tuple[list[tuple[float, ScheduledRequest]], Callable[[ScheduledRequest], float]] | None:
        """When each running request is predicted to end, and what predicts it (``StepCost.seconds_left``, in decode
        passes of the rows that run once the queues and arrivals are in); None before anything predicts them."""
        running = [*self._decoding, *itertools.chain(*self._prefilling.values())]
        rows = len(running) + self.num_waiting + sum(map(len, self._arriving.values()))
        decode_s = self.cost.decode_seconds(min(self.config.max_running, rows))
        if decode_s is None:
            return None
        left = functools.partial(self.cost.seconds_left, decode_s=decode_s)
        return [(left(r), r) for r in running], left

    def _prompt_budget(self, decoding: int, newcomer: bool = False, lone: bool = False) -> int:
        """Prompt tokens this step may compute: the token budget left by the decode rows (a quarter of it at
        least, so a full decode batch cannot starve prompts), cut to what fits in ``step_time_s`` (a share of it
        while a ``newcomer`` is on its way: the step it arrives during is the first thing it waits for) unless
        the tenant computing prompts is ``lone``: then nobody waits for the step, only for its current pass
        (``_pass_tokens``, ``interrupted``), and a burst's prompts share passes instead of one short step each
        (each with a decode pass: on the 2-core CPU a 0.25 s step fits 1-2 of 16 questions)."""
        cfg = self.config
        budget = max(cfg.step_tokens - decoding, cfg.step_tokens // 4, 1)
        if lone:
            return budget
        seconds = cfg.step_time_s * (NEWCOMER_STEP_SHARE if newcomer else 1.0)
        timed = self.cost.prompt_tokens_within(seconds, decoding > 0, self._prompt_tenants())
        if timed is not None:
            budget = min(budget, max(timed, cfg.min_chunk_tokens))
        return budget

    def _pass_tokens(self) -> int | None:
        """The most prompt tokens one forward pass computes (``SchedulerOutput.pass_tokens``): what fits in the
        newcomer's share of ``step_time_s`` at the measured costs (None before a prompt token was measured). A
        lone tenant's step (untimed) runs its chunks in passes of this size, ``interrupted`` between them: another
        tenant arriving waits for the pass in progress. Measured (bench load, 3 repeats): passes of all of
        step_time_s gave 16 streams 7.0x one but the flood's tenant B 2.6x its idle TTFT; passes of half of it
        5.9x and 1.8x; later, of 0.35 of it (each probe of B's arrives ~40 ms into one of A's passes and waits out
        the rest) capped at ``max_pass_tokens`` 1.95x [1.53, 2.08] (docs/bench/HISTORY.md, 2026-12-02)."""
        fit = self.cost.prompt_tokens_within(self.config.step_time_s * NEWCOMER_STEP_SHARE, decoding=False,
                                             tenants=self._prompt_tenants())
        if fit is None:
            return None
        if self.config.max_pass_tokens is not None:
            fit = min(fit, self.config.max_pass_tokens)
        return max(fit, self.config.min_chunk_tokens)

    def _next_prompt(self, tenant: str) -> int:
        """The prompt tokens left of the request ``tenant``'s next turn computes (its oldest started, else its next
        queued one)."""
        started, queue = self._prefilling.get(tenant), self._waiting.get(tenant)
        nxt = started[0] if started else queue[0] if queue else None
        return nxt.remaining_prompt if nxt is not None else 0

    def _lone(self, tenant: str | None = None) -> bool:
        """One tenant at most (``tenant``, when named) has prompt work and none other is on its way."""
        return len(self._prompt_tenants() | set(self._arriving) | ({tenant} if tenant else set())) <= 1

    def _chunk_tokens(self, lone: bool, pass_tokens: int | None) -> int:
        """The most prompt tokens a request computes in a step: a lone tenant's chunks fit its passes (each what
        an arrival may wait for)."""
        return min(self.config.chunk_tokens, pass_tokens or self.config.chunk_tokens) if lone \
            else self.config.chunk_tokens

    def _newcomer_on_its_way(self) -> bool:
        """Another tenant's prompts run while a tenant with none started or queued is announced (``expect``:
        fetching its memories). One already queued needs no shorter step: its chunk runs first in this one."""
        return bool(self._prefilling) and any(t not in self._prefilling and not self._waiting.get(t)
                                              for t in self._arriving)

    def _refuse_a_long_wait(self, tenant: str, room_wait: float = 0.0) -> None:
        """EngineBusyError when the prompts ahead of ``tenant``'s request, or its ``room_wait``, pass their margins."""
        limit, prompts = self.config.queue_timeout_s, self._predicted_wait(tenant)
        if (over := self._first_price(tenant, prompts, room_wait) - limit) > 0:
            raise EngineBusyError(f"tenant {tenant!r}'s request would wait about {max(prompts, room_wait):.0f} s for "
                                  f"the engine (queue timeout {limit:g} s); retry later", retry_after_s=math.ceil(over))

    def _room_wait(self, req: ScheduledRequest) -> float:  # behind its tenant's queue and arrivals; inf: see ``add``
        running = self._running_ends()
        queue = [*self._waiting.get(req.tenant, ()), *self._arriving.get(req.tenant, ()), req]
        wait = self.capacity.room_waits(queue, self._tenants(req), *running)[-1] if running else 0.0
        return wait if math.isfinite(wait) else 0.0

    def _first_price(self, tenant: str, prompts: float, room: float) -> float:
        """A wait first judged, each part over its margin: SHED_AT (an unmeasured tenant's prompts: ..._UNMEASURED)."""
        margin = SHED_AT if tenant in self.cost.tenant_token_s else SHED_AT_UNMEASURED
        return max(prompts / margin, room / SHED_AT)

    def _predicted_wait(self, tenant: str) -> float:
        """Seconds until a request of ``tenant`` queued now gets its prompts ahead computed (those still arriving at
        their typical size or their own, the larger), at its round-robin share of the measured prompt rate."""
        work = self._prompt_work()
        ahead = work.get(tenant, 0) + round(sum(self._arriving_sizes(tenant)))
        return self._queue_seconds(tenant, ahead, work, self._drain(tenant)) if ahead else 0.0

    def _queue_seconds(self, tenant: str, ahead: int, work: dict[str, int],
                       drain: tuple[int, int | None, int | None]) -> float:
        """Seconds until ``tenant``'s ``ahead`` prompt tokens are computed, at its ``_share`` of ``drain``'s steps."""
        share = self._share(tenant, ahead, work)
        per_step, chunk, pass_tokens = drain
        if chunk is not None:  # one chunk a step of each tenant's
            per_step = min(per_step, math.ceil(share * chunk))
        return self.cost.prompt_seconds(ahead, share, per_step, pass_tokens)

    @staticmethod
    def _share(tenant: str, ahead: int, work: dict[str, int]) -> float:
        """Prompt tokens computed for all tenants per one of ``tenant``'s until its ``ahead`` tokens are done
        (``work``: ``_prompt_work``): every tenant with prompt work an equal part, one with less than ``ahead`` until
        done (as a whole tenant, one question of B's halved A's rate: two of A's kept were shed ~1.1 s in)."""
        return 1.0 + sum(min(n, ahead) for t, n in work.items() if t != tenant) / max(ahead, 1)

    def _prompt_work(self) -> dict[str, int]:
        """Each tenant's prompt tokens started or queued, for the tenants that have any."""
        started, queued = self._prefilling, self._waiting
        return {t: sum(r.remaining_prompt for r in itertools.chain(started.get(t, ()), queued.get(t, ())))
                for t in self._prompt_tenants()}

    def _drain(self, tenant: str) -> tuple[int, int | None, int | None]:
        """How a step computes ``tenant``'s queue: (prompt tokens a step, every tenant's included; the chunk a step
        of each tenant's when its prompts, announced ones too, are longer, else None; the most a pass holds). A
        request gets one chunk a step and a tenant finishes a started prompt before another, so longer prompts go a
        chunk a step whatever the budget (priced at the budget, 32 ~2,000-token prompts were predicted at ~1.5 s each
        where they took ~2.25, two kept ones shed 18 and 24 s in; 7 of 11 announced ones refused once retrieved)."""
        lone = self._lone(tenant)
        per_step = self._prompt_budget(len(self._decoding), lone=lone)
        pass_tokens = self._pass_tokens()
        chunk = self._chunk_tokens(lone, pass_tokens)
        modes = {r.mode for r in itertools.chain(self._prefilling.get(tenant, ()), self._waiting.get(tenant, ()))}
        typical = [self._typical_prompt.get((tenant, mode), 0.0) for mode in modes]
        longer = max([*typical, *self._arriving_sizes(tenant)], default=0.0) > chunk
        return per_step, chunk if longer else None, pass_tokens

    def _arriving_sizes(self, tenant: str) -> list[float]:
        """The prompt tokens of ``tenant``'s announced requests: each its own known size or its mode's typical one,
        the larger."""
        return [max(r.prompt_tokens, self._typical_prompt.get((tenant, r.mode), 0.0))
                for r in self._arriving.get(tenant, ())]

    def _prompt_tenants(self) -> set[str]:
        """Tenants with prompt work started or queued: the round-robin's share of the prompt rate."""
        return {*self._prefilling, *(t for t, q in self._waiting.items() if q)}

    def _shed(self) -> list[ScheduledRequest]:
        """Queued requests that, at the costs measured now, would wait out the queue timeout: a burst accepted on a
        guess (before its prompts were measured) is refused within steps; so is a queue whose first request waits for
        room (capacity.py) the running requests' predicted ends would not give in time. A first look judges as an
        arrival is (``_first_price``): 8 kept at ~21 s of 30 without a margin were refused 1.2-3.4 s in."""
        now, limit = self.clock(), self.config.queue_timeout_s
        work, running = self._prompt_work(), self._running_ends() if self.num_waiting else None
        shed = []
        for tenant, queue in self._waiting.items():
            ahead = sum(r.remaining_prompt for r in self._prefilling.get(tenant, ()))
            drain = self._drain(tenant)
            rooms = self.capacity.room_waits(queue, self._tenants(queue[0]), *running) if queue and running else ()
            for req, room in itertools.zip_longest(list(queue), rooms, fillvalue=0.0):
                prompts = self._queue_seconds(tenant, ahead, work, drain)
                # a first look judges as an arrival is judged; once kept, the timeout alone
                wait = max(room, prompts) if req.kept else self._first_price(tenant, prompts, room)
                if now - req.arrived + wait > limit:
                    queue.remove(req)
                    shed.append(req)
                else:
                    req.kept, ahead = True, ahead + req.remaining_prompt
        return shed

    def _remove(self, req: ScheduledRequest) -> None:
        self.capacity.give(req)
        if req in self._decoding:
            self._decoding.remove(req)
        started = self._prefilling.get(req.tenant, [])
        if req in started:
            started.remove(req)
            if not started:
                del self._prefilling[req.tenant]
        queue = self._waiting.get(req.tenant)
        if queue and req in queue:
            queue.remove(req)

    def _drop_cancelled(self) -> list[ScheduledRequest]:
        gone = [r for r in itertools.chain(self._decoding, *self._prefilling.values(), *self._waiting.values())
                if r.cancelled]
        for r in gone:
            self._remove(r)
        return gone

    def _expire(self) -> list[ScheduledRequest]:
        now, limit = self.clock(), self.config.queue_timeout_s
        expired = []
        for queue in self._waiting.values():
            while queue and now - queue[0].arrived > limit:
                expired.append(queue.popleft())
        return expired
