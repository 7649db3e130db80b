"""What a step costs, as measured: seconds per prompt token and per decode pass (moving averages).

The scheduler uses it twice (issue 22): to bound a step's *time* while other tenants wait (a flood of long prompts
must not make every step long), and to predict how long a new request would wait for its prompt to start, so a
request that would outwait the queue timeout is refused at once (503 + Retry-After) instead of after the timeout.
No torch: the loop reports wall times, the scheduler reads estimates; tests feed made-up numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from inferscale.engine.scheduled import ScheduledRequest

# Weight of the newest observation: a few steps follow a change of load (a flood starting) without one slow step
# (a page fault, another process) swinging the estimate.
SMOOTHING = 0.2
# What a wait is predicted with before anything was measured (a burst at start-up): a prompt token at 2 ms, about
# what Gemma-3-270M's prompt passes cost on the 2-core CPU, so a cold burst is shed on arrival rather than after
# the queue timeout. Conservative for shedding; on a faster device the first measured step replaces it.
PROMPT_TOKEN_S_PRIOR = 0.002
# A prompt pass of fewer tokens than this moves the per-token estimate in proportion: its time is mostly the
# pass's fixed part, whose noise (a decode pass here: 49-75 ms) over 3 tokens said 8.7 ms a token, where one
# more token costs about 1 ms, and the estimate it pulled up cut a 35-token question into 32 + 3 (two passes).
FULL_WEIGHT_TOKENS = 32
# The most a whole step is believed to overrun what its passes are priced at (``StepCost.overrun``): one step the OS
# held up must not make admission refuse everything.
OVERRUN_MAX = 4.0
# The most a decode pass is believed to run past what it was predicted to take, once a row's cost is known: one pass
# the OS or a collection held up then moves the estimates little, where a sustained slowdown is still learnt within
# a hundred passes (ROW_SMOOTHING). Through the server one 56-row pass of 441 ms against ~80 (rows moving, since left
# out of it) doubled a row's price at once (1.39 -> 2.83 ms), which refuses requests kept for room.
DECODE_OUTLIER_X = 2.0
# Weight of the newest pass in a row's price (``decode_row_s``), smaller than SMOOTHING: that price predicts waits for
# room, hundreds of passes long, so it follows the mean of many passes rather than the last few. A fresh server's
# first 64-request hold: its first 30 full passes took 100-134 ms, the next ~230 about 80; at SMOOTHING the kept
# queue's wait was priced past the timeout and refused 2.6 s in, though room came 21-24 s after arrival in the
# same burst's other runs (those passes replayed: the worst total wait priced 34.3 s at 0.2, 25.7 at this weight).
ROW_SMOOTHING = 0.03
# Tenants whose own prompt-token cost is remembered (the most recently observed; older ones fall back to the
# overall estimate).
TENANTS_KEPT = 1024


@dataclass
class StepCost:
    """A forward pass costs a fixed part (every weight read once, the per-operation overhead: what a one-row
    decode pass costs) plus a part per prompt token. Both matter: measured on the 2-core CPU, one 36-token prompt
    pass 78-99 ms, sixteen in one padded pass (576 tokens) 450-500 ms, a one-row decode pass 55-79 ms. Seconds
    over tokens of a short pass (2-3 ms a token) would say one step fits a quarter of the prompts that do fit."""

    # seconds per prompt token beyond the pass's fixed part (chunked prefill, any mode): what one more prompt
    # token in a pass costs (the fetch planner's recompute cost too: recomputed tokens ride in the question's pass)
    prompt_token_s: float | None = None
    decode_pass_s: float | None = None  # seconds of one batched decode pass at the current batch size
    # seconds each decode row adds to a pass beyond its fixed part (``pass_s``): what a pass of the rows running
    # now will take, where the moving average still follows the smaller batches before them (``decode_seconds``).
    # A least-squares slope over the recent passes (``_row_fit``, decayed by ROW_SMOOTHING), so a pass of many rows
    # outweighs one of two, whose time the OS moves by more than a row costs: a per-pass average of
    # (seconds - pass_s) / (rows - 1) read 9.5 ms a row after a flood where 56 rows cost 1.2 ms each, and a burst that
    # would have run was refused.
    decode_row_s: float | None = None
    _row_fit: tuple[float, float] = field(default=(0.0, 0.0), repr=False)  # decayed sums of (rows-1)*extra, (rows-1)^2
    # the fastest decode pass seen: the fixed part of any pass (a prompt pass reads every weight as it does);
    # None before a decode pass was measured (a prompt token then costs what its passes cost, fixed part and all)
    pass_s: float | None = None
    # the shortest prompt pass seen: the prediction's decode cost until a decode pass was measured (a server
    # whose first requests asked one token)
    shortest_pass_s: float | None = None
    _fixed_part_unknown: bool = field(default=False, repr=False)  # prompt_token_s was measured without pass_s
    # Each tenant's own seconds per prompt token: a token's cost grows with the context it attends to, so one
    # tenant's short questions (k=3) say little of another's long prompts (k=40 memories of text). Measured in a
    # flood: right after tenant B's cheap passes the shared estimate sized tenant A's next pass at 87 tokens, which
    # took 170-230 ms against the 125 ms it was meant to fit, and B's next request waited it out.
    tenant_token_s: dict[str, float] = field(default_factory=dict, repr=False)
    # How much longer a whole step with prompt work takes than the model prices it at (>= 1): the passes are timed
    # alone, while a step also holds the scheduler, each token's emission, questions interjected into its passes
    # and the server's threads on the same cores. Measured under a flood of 32 ~2,000-token prompts: each took
    # ~2.25 s of wall time to compute where the passes priced it at ~1.57 s, so admission, and the shedding after
    # it, kept requests that then waited out the queue timeout, two of them refused 18 and 24 s late.
    overrun: float = 1.0
    # Each tenant's answers' share of the tokens they may generate (``max_tokens``), as its answers end: what a
    # running request is predicted to generate (``seconds_left``). All of them until one of the tenant's ended: a
    # burst's first answers end at once or not at all before the queue timeout (a hold of every slot by 256-token
    # answers: the requests beyond its part waited the timeout out, 30.5-30.8 s, and were refused then).
    answer_share: dict[str, float] = field(default_factory=dict, repr=False)

    def observe_prefill(self, tokens: int, seconds: float, passes: int = 1, tenants: Iterable[str] = (),
                        taking_in: bool = False) -> None:
        """``passes`` prompt passes computed ``tokens`` prompt tokens of ``tenants``' requests in ``seconds``;
        ``taking_in``: a burst of requests was being taken in meanwhile (``Scheduler.taking_in``), so the passes
        shared the cores with their work: they may lower the estimates, not raise them (``learn``)."""
        if tokens > 0 and seconds > 0:
            per_token = seconds / tokens
            # a quarter of the whole cost at least: a pass timed under its fixed part (noise) says nothing of it
            marginal = max((seconds - passes * (self.pass_s or 0.0)) / tokens, per_token / 4)
            weight = SMOOTHING * min(1.0, tokens / FULL_WEIGHT_TOKENS)
            # Before a decode pass told the fixed part, a token's cost is its pass's share: a stand-in the first
            # observation with the fixed part known replaces instead of averaging with (it is 2-4x too high).
            # Stand-ins average with each other like any observation: one pass the OS held up (a 7-token pass of
            # 1.3 s on a loaded 2-core machine, against 7 ms) must not set the rate that sheds requests.
            replace = self._fixed_part_unknown and self.pass_s is not None
            self.prompt_token_s = learn(None if replace else self.prompt_token_s, marginal, weight, taking_in)
            for tenant in tenants:
                old = None if replace else self.tenant_token_s.get(tenant)
                remember(self.tenant_token_s, tenant, learn(old, marginal, weight, taking_in))
            self._fixed_part_unknown = self.pass_s is None
            per_pass = seconds / max(passes, 1)
            self.shortest_pass_s = min(self.shortest_pass_s or per_pass, per_pass)

    def observe_decode(self, seconds: float, rows: int = 1) -> None:
        if seconds > 0:
            if self.decode_row_s is not None and self.pass_s is not None:
                seconds = min(seconds, DECODE_OUTLIER_X * self.decode_seconds(rows))
            self.decode_pass_s = ewma(self.decode_pass_s, seconds)
            self.pass_s = min(self.pass_s or seconds, seconds)
            if rows > 1:
                extra, n, (num, den) = max(seconds - self.pass_s, 0.0), rows - 1, self._row_fit
                self._row_fit = num * (1 - ROW_SMOOTHING) + n * extra, den * (1 - ROW_SMOOTHING) + n * n
                self.decode_row_s = self._row_fit[0] / self._row_fit[1]

    def decode_seconds(self, rows: int) -> float | None:
        """A decode pass of ``rows`` rows: the fixed part and each row's, once passes of more than one row were
        measured, else the moving average; None before any."""
        if self.decode_row_s is None or self.pass_s is None:
            return self.decode_pass_s
        return self.pass_s + max(rows - 1, 0) * self.decode_row_s

    def observe_step(self, seconds: float, prompt_tokens: int, passes: int, decoded: bool,
                     taking_in: bool = False) -> None:
        """A whole step (scheduling, passes, emission) took ``seconds`` and computed ``prompt_tokens`` prompt
        tokens in ``passes`` prompt passes, beside a decode pass when ``decoded``: how far it ran past the price
        ``prompt_seconds`` puts on that work (``taking_in`` as for ``observe_prefill``)."""
        if prompt_tokens <= 0 or seconds <= 0 or self.prompt_token_s is None:
            return
        priced = self._price(prompt_tokens, passes, decoded)
        weight = SMOOTHING * min(1.0, prompt_tokens / FULL_WEIGHT_TOKENS)
        self.overrun = learn(self.overrun, min(max(seconds / priced, 1.0), OVERRUN_MAX), weight, taking_in)

    def _price(self, prompt_tokens: int, passes: int, decode_passes: int) -> float:
        """What the passes cost at the measured rates. Every pass is priced at the fixed part once it is known:
        the rows that will decode beside a queue's prompts are mostly its own first ones, few, where the latest
        decode pass (the one moving average) may be a 16-row batch long finished, or a cold start's (74 ms where
        a pass then took 15); what whole steps take beyond that is ``overrun``'s."""
        token_s = self.prompt_token_s if self.prompt_token_s is not None else PROMPT_TOKEN_S_PRIOR
        if self.pass_s is not None:
            return prompt_tokens * token_s + (passes + decode_passes) * self.pass_s
        decode_s = self.decode_pass_s if self.decode_pass_s is not None else (self.shortest_pass_s or 0.0)
        return prompt_tokens * token_s + decode_passes * decode_s

    def observe_answer(self, tenant: str, generated: int, new_tokens: int) -> None:
        """One of ``tenant``'s answers ended after ``generated`` of the ``new_tokens`` it could have."""
        if new_tokens > 0:
            remember(self.answer_share, tenant, ewma(self.answer_share.get(tenant), min(generated / new_tokens, 1.0)))

    def seconds_left(self, req: ScheduledRequest, decode_s: float) -> float:
        """How long the running ``req`` is predicted to hold its slot and K/V: its prompt tokens still to compute and
        the tokens its tenant's answers are seen to take (``answer_share``), at least one, in decode passes of
        ``decode_s`` seconds each (``decode_seconds``)."""
        tokens = max(math.ceil(self.answer_share.get(req.tenant, 1.0) * req.new_tokens) - req.generated, 1)
        return tokens * decode_s + req.remaining_prompt * (self.prompt_token_s or PROMPT_TOKEN_S_PRIOR)

    def prompt_tokens_within(self, seconds: float, decoding: bool, tenants: Iterable[str] = ()) -> int | None:
        """How many prompt tokens fit in ``seconds`` in one prompt pass (beside one decode pass when
        ``decoding``) at the dearest of ``tenants``' own token costs (the overall estimate for a tenant not measured
        yet, or when none is named); None before a prompt token was measured."""
        if self.prompt_token_s is None:
            return None
        token_s = max([self.tenant_token_s.get(t, self.prompt_token_s) for t in tenants] or [self.prompt_token_s])
        left = seconds - (self.pass_s or 0.0) - ((self.decode_pass_s or 0.0) if decoding else 0.0)
        return int(max(0.0, left) / token_s + 1e-9)  # 0.05 / 0.001 is 49.999...

    def prompt_seconds(self, tokens: int, share: float, per_step: int, pass_tokens: int | None = None) -> float:
        """Seconds until ``tokens`` prompt tokens are computed when each step computes ``per_step`` of them, split
        ``share`` ways, in passes of at most ``pass_tokens`` beside a decode pass: at the measured costs,
        PROMPT_TOKEN_S_PRIOR and the shortest prompt pass standing in for what was not measured yet, stretched by
        how far whole steps have run past their price (``overrun``)."""
        if tokens <= 0:
            return 0.0
        total = tokens * share
        steps = math.ceil(total / max(per_step, 1))
        passes = max(steps, math.ceil(total / pass_tokens)) if pass_tokens else steps
        return self._price(total, passes, steps) * self.overrun


def ewma(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    """The moving average after ``new`` (``old`` None: the first observation)."""
    return new if old is None else old + weight * (new - old)


def remember(table: dict[str, float], tenant: str, value: float) -> None:
    """``tenant``'s ``value`` into ``table``, re-inserted as its newest entry; the oldest go past TENANTS_KEPT (a
    tenant not seen for that many others is measured anew)."""
    table.pop(tenant, None)
    table[tenant] = value
    while len(table) > TENANTS_KEPT:
        del table[next(iter(table))]


def learn(old: float | None, new: float, weight: float, taking_in: bool) -> float:
    """The estimate after observing ``new``: its moving average, which does not rise while a burst is taken in
    (``taking_in``: the passes shared the cores with the arrivals' work, takein.py has what that cost; learnt, the
    transient shed kept requests ~1 s in that the steady cost would have served). A first observation, of a tenant
    not measured yet, is taken as it is: it is all there is of it."""
    value = ewma(old, new, weight)
    return value if old is None or not taking_in else min(old, value)
