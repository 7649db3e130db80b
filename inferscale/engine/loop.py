"""The serving loop: the one path from a prompt to its tokens. ``Engine.ask``, the benchmarks and the server's
worker thread are all clients of ``ServingLoop``.

``step()`` has three beats (nano-vllm's shape):
  schedule     the Scheduler picks the running sequences to decode and the prompt chunks to compute
  forward      the prompt chunks (at most ``chunk_tokens`` each) in padded passes, like lengths together
               (promptbatch.py); then one batched pass advances every running sequence a token (SlotCache rows)
  postprocess  sample, detokenize, emit events, stop, free slots
A long ``text`` prompt is prefilled chunk by chunk, so running streams wait at most one chunk per step.

The fault boundary: whatever one request's admission, prompt chunk, decode row or sampling raises fails that
request alone (an ``ErrorEvent`` to its client) and the step goes on for the others. A batched decode pass that
raises is run again row by row, and a batched prompt pass chunk by chunk, so only the rows that fail alone fail.
An exception out of ``step`` is the loop's bug, not a request's: fatal to the worker (``inferscale.engine.worker``).

Slots: rows [0, decoding) hold decoding sequences, the rows after them sequences still prefilling, so the batched
decode reads contiguous rows (a view, no gather). Rows move only when a sequence starts decoding or finishes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from inferscale.contract import MODES
from inferscale.engine import tokenchoice
from inferscale.engine.cache import inject_into_slot
from inferscale.engine.detokenize import AnswerText
from inferscale.engine.interject import Interjector
from inferscale.engine.promptbatch import next_piece, padded_groups
from inferscale.engine.request import DoneEvent, ErrorEvent, Event, GenRequest, TokenEvent
from inferscale.engine.sampling import find_stop, held_back, sample
from inferscale.engine.scheduled import ScheduledRequest
from inferscale.engine.scheduler import NEWCOMER_PASS_TOKENS, NEWCOMER_STEP_SHARE, Arrival, Scheduler, SchedulerConfig
from inferscale.engine.slots import FIRST_CAPACITY, FIRST_SLOTS, SlotCache
from inferscale.engine.spans import request_span
from inferscale.engine.steptally import StepTally
from inferscale.engine.threads import pin_threads, tuned_choices
from inferscale.engine.threadtuner import ThreadTuner
from inferscale.models.greedyhead import Head
from inferscale.errors import ConfigError, InvalidInputError, EngineBusyError, PromptTooLongError

if TYPE_CHECKING:
    from inferscale.engine.loopengine import LoopEngine as Engine  # what the loop reads of an Engine

log = logging.getLogger(__name__)
T = TypeVar("T")

class ServingLoop:
    def __init__(self, engine: Engine, config: SchedulerConfig | None = None, *, slots: int = FIRST_SLOTS,
                 slot_tokens: int = FIRST_CAPACITY) -> None:
        self.engine = engine
        loaded = engine.loaded
        config = config or SchedulerConfig()
        self.kernel_rows = loaded.pass_rows  # no pass holds more: past them the model's kernels change
        if config.max_pass_tokens is None and self.kernel_rows is not None:  # timed passes stay on those kernels
            config = dataclasses.replace(config, max_pass_tokens=min(self.kernel_rows, NEWCOMER_PASS_TOKENS))
        self.scheduler = Scheduler(config)
        # the slot pool the loop starts with (a server reserves its expected load: slots.py), never past what the
        # scheduler runs at once or the model's context, which a CPU's pool addresses from the start
        most = config.max_running, loaded.layout.max_positions
        self.slots = SlotCache(loaded.layout, engine.prefix_kv.dtype, loaded.device, slots=min(slots, most[0]),
                               capacity=min(slot_tokens, most[1]), most=most)
        reserved = self.slots.reserved[0] * self.slots.reserved[1]
        if config.kv_tokens is not None and reserved > config.kv_tokens:  # backed from the start: part of it
            raise ConfigError(f"the slot pool's reservation ({reserved} tokens) is more than the K/V budget of "
                              f"the running requests ({config.kv_tokens} tokens)")
        self.rows: list[GenRequest] = []  # by slot: [0, decoding) decode, then prefilling
        self.decoding = 0
        self.steps = 0
        self.tally = StepTally()  # each step's wall time by the rows it decoded (/metrics, bench load)
        self.threads = ThreadTuner(tuned_choices(), pin_threads)  # a no-op after an explicit count
        self.interject = Interjector(self.scheduler, self._fits_between_layers, self._interjected,
                                     config.step_time_s * NEWCOMER_STEP_SHARE)
        self._settling: list[GenRequest] = []  # prompts done inside a paused pass: they join the decoding rows after

    # ---- any thread -------------------------------------------------------------------------------------------
    def add(self, req: GenRequest) -> None:
        """Validate and queue ``req``: typed errors (bad mode, foreign block, too long, queue full) raise here."""
        eng = self.engine
        if req.mode not in MODES:
            raise InvalidInputError(f"mode {req.mode!r}: expected one of {', '.join(MODES)}", param="mode")
        if not req.ids:
            raise InvalidInputError("empty query", param="messages")
        blocks = [] if req.mode == "none" else req.blocks
        for b in blocks:
            eng.check_block(b)
        if req.recompute_ids and req.mode != "kv":
            raise InvalidInputError(f"memory tokens to recompute need mode 'kv', not {req.mode!r}", param="mode")
        req.blocks = blocks
        req.stops = req.sampling.stops(eng.template.default_stop)
        p, memory = len(eng.prefix_ids), sum(b.num_tokens for b in blocks)
        total = p + memory + len(req.recompute_ids) + len(req.ids)
        limit = eng.loaded.layout.max_positions
        if total + req.sampling.max_new_tokens > limit:
            raise PromptTooLongError(f"prompt of {total} tokens + {req.sampling.max_new_tokens} to generate exceeds "
                                     f"the model's context of {limit}")
        computed = p if req.mode == "text" else p + memory
        req.sched = ScheduledRequest(tenant=req.tenant, prompt_tokens=total, computed_tokens=computed,
                                     new_tokens=req.sampling.max_new_tokens, payload=req, mode=req.mode)
        self.scheduler.add(req.sched)

    def expect(self, tenant: str, prompt_tokens: int = 0, mode: str = "", new_tokens: int = 0) -> Arrival:
        """Announce a request of ``tenant`` before its blocks are fetched (Scheduler.expect: refused early)."""
        return self.scheduler.expect(tenant, prompt_tokens, mode, new_tokens)

    @property
    def active(self) -> int:
        return self.scheduler.num_running

    @property
    def queued(self) -> int:
        return self.scheduler.num_waiting

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop's thread ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        t0, taking_in, grown_s = time.perf_counter(), self.scheduler.taking_in(), self.slots.grown_s
        out = self.scheduler.schedule()
        for s in out.cancelled:
            self._free(s.payload)
        limit = self.scheduler.config.queue_timeout_s
        for s in out.expired:
            s.payload.emit(ErrorEvent(EngineBusyError(f"request waited over {limit:g} s for the engine; retry later",
                                                      retry_after_s=self.scheduler.retry_after_s())))
        self._refuse(out.shed)
        decode = [s.payload for s in out.decode]
        for s in out.admitted:
            self._guarded(s.payload, self._admit)
        # Prompt chunks first, in the scheduler's turn order (a newcomer's first): a short question that fits in
        # one chunk gets its first token before this step's decode pass, not after it.
        cost = self.scheduler.cost  # measured here, read by the scheduler's time bound and admission check
        prompt_tokens, prompt_passes = self._prefill([(s.payload, n) for s, n in out.prefill
                                                      if s.payload.slot >= 0 and s.payload.pending], out.pass_tokens)
        t1, aside_at_decode = time.perf_counter(), self.slots.aside_s
        decode = [r for r in decode if r.slot >= 0]
        if decode:
            self.threads.before_decode(len(decode))
            self._decode(decode)
            took = time.perf_counter() - t1 - self.interject.take_elapsed() - (self.slots.aside_s - aside_at_decode)
            self.threads.after_decode(len(decode), took)
            cost.observe_decode(took, len(decode))
        self._settle()  # rows wait until no pass is paused; none decodes before the next step
        waited = time.perf_counter() - t0  # what the rows waited, a growth included: the tally's
        took = waited - (self.slots.grown_s - grown_s)  # a growth is no step's cost (slots.py)
        cost.observe_step(took, prompt_tokens, prompt_passes, bool(decode), taking_in or self.scheduler.taking_in())
        self.tally.add(len(decode), prompt_tokens, waited)
        self.steps += 1

    def _refuse(self, shed: list) -> None:
        """Answer the requests the scheduler shed (they would outwait the queue timeout): 503 + Retry-After."""
        for s in shed:
            s.payload.emit(ErrorEvent(EngineBusyError(
                f"request would wait over {self.scheduler.config.queue_timeout_s:g} s for the engine at its measured "
                "speed; retry later", retry_after_s=self.scheduler.retry_after_s())))

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    # ---- beats ------------------------------------------------------------------------------------------------
    def _guarded(self, req: GenRequest, beat: Callable[..., T], *args: object) -> T | None:
        """The fault boundary: run ``beat(req, *args)`` and return what it returns; what it raises fails ``req``
        alone (None then)."""
        try:
            return beat(req, *args)
        except Exception as e:  # noqa: BLE001 - the request's own failure, reported to its client
            self._fail(req, e)
            return None

    def _admit(self, req: GenRequest) -> None:
        """Give ``req`` a slot, filled with what it starts from right before its first prompt pass (``_fill``)."""
        eng = self.engine
        req.span = request_span(req, "prefill", **{"inferscale.mode": req.mode, "inferscale.blocks": len(req.blocks)})
        req.answer_text = AnswerText(eng.tokenizer)
        req.slot = len(self.rows)
        self.rows.append(req)
        self._trim()
        if req.sampling.seed is not None:  # on the logits' device: a CPU generator cannot draw on CUDA tensors
            req.generator = torch.Generator(device=eng.device).manual_seed(req.sampling.seed)
        if req.mode == "kv-recompute" and req.blocks:
            from inferscale.engine.recompute import recompute_kv

            kv, logits = recompute_kv(eng, req.blocks, req.ids, req.recompute_ratio)
            self.slots.write(req.slot, kv)
            req.length = kv.shape[3]
            self._prompt_done(req, logits)
            return
        # text computes its memories' tokens, kv what it recomputes behind the injected blocks; chunked
        memory = [t for b in req.blocks for t in b.token_ids] if req.mode == "text" else list(req.recompute_ids)
        req.pending, req.slot_filled = memory + list(req.ids), False  # filled before its first prompt pass (_fill)

    def _prefill(self, chunks: list[tuple[GenRequest, int]], pass_tokens: int | None) -> tuple[int, int]:
        """Compute the step's prompt chunks (request, tokens) in padded groups, one forward pass each (promptbatch)
        of at most ``pass_tokens`` padded tokens, a longer chunk in pieces over successive passes (one 123-token
        chunk was a 145 ms pass a newcomer waited out); once another tenant's request waits, the rest waits for the
        next step, where it goes first. Each pass's time goes to the cost model with the tenants it computed for.
        Returns the prompt tokens computed and the passes they took."""
        chunks = [(r, min(n, len(r.pending))) for r, n in chunks]
        first, done, passes = True, 0, 0
        while chunks:
            sliver = self.scheduler.config.min_chunk_tokens
            pieces = [(r, next_piece(n, pass_tokens, sliver, self.kernel_rows)) for r, n in chunks]
            groups = padded_groups([n for _, n in pieces], max_tokens=pass_tokens)
            going_on = {r.sched.tenant for (r, n), (_, m) in zip(chunks, pieces) if n > m}
            for k, group in enumerate(groups):
                if not first:
                    # the tenants the rest of the step computes for: another's request waiting goes first
                    tenants = going_on | {pieces[i][0].sched.tenant for g in groups[k:] for i in g}
                    if self.scheduler.interrupted(tenants):
                        return done, passes
                    self._refuse(self.scheduler.shed_queued())
                first = False
                for r in [pieces[i][0] for i in group if not pieces[i][0].slot_filled and pieces[i][0].slot >= 0]:
                    self._guarded(r, self._fill)
                batch = [pieces[i] for i in group if pieces[i][0].slot >= 0]  # not failed by an earlier group
                t0, taking_in, aside_s = time.perf_counter(), self.scheduler.taking_in(), self.slots.aside_s
                if len(batch) == 1:
                    computed = self._guarded(batch[0][0], self._prefill_chunk, batch[0][1]) or 0
                else:
                    computed = self._prefill_batch(batch) if batch else 0
                # neither the questions run between its layers nor the slot cache growing or moving rows are its cost
                took = time.perf_counter() - t0 - self.interject.take_elapsed() - (self.slots.aside_s - aside_s)
                self.scheduler.cost.observe_prefill(computed, took, 1, {r.sched.tenant for r, _ in batch},
                                                    taking_in or self.scheduler.taking_in())
                done, passes = done + computed, passes + 1
            chunks = [(r, n - m) for (r, n), (_, m) in zip(chunks, pieces) if n > m and r.slot >= 0 and r.pending]
        return done, passes

    def _fill(self, req: GenRequest) -> None:
        """``req``'s slot gets the prefix, and in kv modes its blocks (each layer group windowed: flat in k), right
        before its first prompt pass: a burst's admissions filled at once held up the step for every tenant (a fresh
        server's first burst of k=20 requests, 15-16 of them in 200-250 ms, first touches of pages), where between
        passes another tenant's request on its way goes first (``Scheduler.interrupted``)."""
        eng = self.engine
        if req.mode != "text" and req.blocks:
            req.length = inject_into_slot(self.slots, req.slot, eng.prefix_kv, req.blocks, eng.loaded.layout)
        else:
            self.slots.write(req.slot, eng.prefix_kv)
            req.length = eng.prefix_kv.shape[3]
        req.slot_filled = True

    def _prefill_batch(self, batch: list[tuple[GenRequest, int]]) -> int:
        """One forward pass over several requests' next prompt chunks: each a row, padded to the longest with
        copies of its last token. The padding writes K/V past the row's length, where the causal mask hides it
        from the row's real tokens and its later tokens overwrite it. A pass that raises is run again chunk by
        chunk, so only the chunks that fail alone fail."""
        batch = sorted(batch, key=lambda c: c[0].slot)  # contiguous rows where they are: a view, no gather
        chunks = [r.pending[:n] for r, n in batch]
        width = max(map(len, chunks))
        ids = torch.tensor([c + c[-1:] * (width - len(c)) for c in chunks])
        try:
            head = self._last_rows([r.slot for r, _ in batch], [r.length for r, _ in batch], ids,
                                   [len(c) - 1 for c in chunks])
        except Exception:  # noqa: BLE001 - one chunk may have broken the pass: each chunk again, alone
            log.warning("batched prompt pass of %d chunks failed; retrying each alone", len(batch), exc_info=True)
            return sum(self._guarded(r, self._prefill_chunk, n) or 0 for r, n in batch if r.slot >= 0)
        # Every row's length first: a row that fails in _prompt_done is freed, which moves other rows' slots, and
        # a move copies a row's first ``length`` tokens.
        for (req, _), chunk in zip(batch, chunks):
            self._computed(req, chunk)
        finishing = [req for req, _ in batch if not req.pending]
        if finishing:  # a pass of chunks that all go on needs no LM head (the screen's 10 ms, the head's 18)
            for (req, _), (lg, g) in zip(batch, self._choices(head, finishing)):
                if not req.pending:
                    self._guarded(req, self._prompt_done, lg, g)
        return sum(map(len, chunks))

    def _prefill_chunk(self, req: GenRequest, n: int) -> int:
        """Compute the next ``n`` prompt tokens of ``req`` alone; returns how many were computed."""
        ids = req.pending[:n]
        head = self._last_rows([req.slot], [req.length], torch.tensor([ids]))
        self._computed(req, ids)
        if not req.pending:
            self._prompt_done(req, *self._choices(head, [req])[0])
        return len(ids)

    def _computed(self, req: GenRequest, ids: list[int]) -> None:
        """``ids``, the next prompt tokens of ``req``, are in its slot."""
        req.pending = req.pending[len(ids):]
        req.length += len(ids)
        self.scheduler.computed(req.sched, len(ids))

    def _prompt_done(self, req: GenRequest, logits: torch.Tensor | None, greedy: int | None = None) -> None:
        if req.sched.remaining_prompt > 0:  # kv-recompute computed it all at once
            self.scheduler.computed(req.sched, req.sched.remaining_prompt)
        else:
            self.scheduler.computed(req.sched, 0)
        req.span.set_attribute("inferscale.prompt_tokens", req.sched.prompt_tokens)
        req.span.set_attribute("inferscale.memory_tokens", req.memory_tokens)
        req.span.set_attribute("inferscale.recomputed_tokens", len(req.recompute_ids))
        req.span.set_attribute("inferscale.query_tokens", len(req.ids))
        req.span.end()
        req.span = request_span(req, "decode")
        if req.keep_first_logits:  # _choices computed them (tokenchoice.needs_logits)
            req.first_logits = logits.detach().float().cpu().clone()
        # It decodes from now on: move it to the end of the decoding rows (after the pass, inside a paused one).
        if self.interject.nested:
            self._settling.append(req)
        else:
            self._swap(req, self.decoding)
            self.decoding += 1
        self._postprocess(req, logits, greedy)

    def _decode(self, reqs: list[GenRequest]) -> None:
        reqs = sorted(reqs, key=lambda r: r.slot)
        try:
            head = self._last_rows([r.slot for r in reqs], [r.length for r in reqs],
                                   torch.tensor([[r.last] for r in reqs]))
        except Exception:  # noqa: BLE001 - one row may have broken the pass: each row again, alone
            log.warning("batched decode of %d rows failed; retrying each row alone", len(reqs), exc_info=True)
            for r in reqs:
                if r.slot >= 0:
                    self._guarded(r, self._decode_alone)
            return
        for r in reqs:
            r.length += 1
        # the last slot first: a row that ends is then the last running, freed with nothing moved (in slot order a
        # 56-row burst ending in one pass moved each row's K/V into a freed slot: that pass took 441 ms against ~80)
        for r, (lg, g) in reversed(list(zip(reqs, self._choices(head, reqs)))):
            self._guarded(r, self._postprocess, lg, g)

    def _choices(self, head: Head, deciding: list[GenRequest]) -> list[tuple[torch.Tensor | None, int]]:
        return tokenchoice.choices(head, deciding, self.engine.stop_ids)

    def _decode_alone(self, req: GenRequest) -> None:
        head = self._last_rows([req.slot], [req.length], torch.tensor([[req.last]]))
        req.length += 1
        self._postprocess(req, *self._choices(head, [req])[0])

    def _last_rows(self, rows: list[int], starts: list[int], ids: torch.Tensor,
                   last: list[int] | None = None) -> Head:
        """Rows' tokens ``ids`` [B, q] at positions starts[b].. through the model, stopped before the LM head at
        each row's token at index last[b] (default: its last): ``Head.logits()`` [B, vocab] in the model's dtype
        (converting them is the sampler's business: argmax needs no fp32 copy), or ``Head.argmax()``. Only those
        positions reach the LM head (a [B, 1] ``logits_to_keep``: the model's own path, final soft-capping
        included)."""
        q = ids.shape[1]
        dev = self.engine.device
        cache = self.slots.view(rows, starts, q)
        pos = torch.tensor(starts)[:, None] + torch.arange(q)[None]
        keep = 1 if last is None else torch.tensor(last, device=dev)[:, None]
        with self.interject.around(self.engine.loaded.lean_pass, {self.rows[r].sched.tenant for r in rows}):
            return self.engine.loaded.last_rows(ids.to(dev), pos.to(dev), self.slots.mask(starts, q), cache, keep)

    # ---- another tenant's prompt inside a paused pass (interject.py) --------------------------------------------
    def _fits_between_layers(self, s: ScheduledRequest) -> bool:
        """A queued request whose whole prompt is one short pass (at most ``max_pass_tokens``, else 64) and needs
        neither a new slot tensor nor more capacity (a paused pass's rows must stay where they are), and no
        kv-recompute scoring pass."""
        most = self.scheduler.config.max_pass_tokens or NEWCOMER_PASS_TOKENS
        return (s.remaining_prompt <= most and s.prompt_tokens <= self.slots.capacity
                and len(self.rows) < self.slots.slots and s.payload.mode != "kv-recompute")

    def _interjected(self, s: ScheduledRequest) -> None:
        req = s.payload
        self._guarded(req, self._admit)
        if req.span is not None:  # its trace shows where its prompt ran
            req.span.set_attribute("inferscale.interjected", True)
        if req.slot >= 0 and req.pending:
            self._prefill([(req, len(req.pending))], None)

    def _settle(self) -> None:
        """The prompts finished inside a paused pass join the decoding rows, now that no pass is paused."""
        for req in self._settling:
            if req.slot >= self.decoding:
                self._swap(req, self.decoding)
                self.decoding += 1
        self._settling.clear()

    def _postprocess(self, req: GenRequest, logits: torch.Tensor | None, greedy: int | None = None) -> None:
        """Sample the next token (``greedy``: the argmax of ``logits``, when already known; ``logits`` may then be
        None where ``tokenchoice.decides`` it), emit its text, and stop or keep the request running."""
        eng, sampling = self.engine, req.sampling
        if greedy is not None and tokenchoice.decides(req, greedy, eng.stop_ids):
            token = greedy  # what sample() would choose: argmax is exact in any dtype (bf16 -> fp32 is lossless)
        else:
            token = sample(logits.float(), sampling, req.generator, tokenchoice.banned(req, eng.stop_ids))
        if req.first_token is None:
            req.first_token = token
        if not sampling.ignore_eos and token in eng.stop_ids:
            self._finish(req, "stop")
            return
        req.output.append(token)
        req.sched.generated = len(req.output)  # the scheduler predicts when it ends (stepcost.seconds_left)
        said = len(req.answer_text.text)
        grew = req.answer_text.add(token)
        now = time.perf_counter()
        if not grew:  # a partial UTF-8 character held back, or a special token: nothing new to say
            req.emit(TokenEvent(token, "", now))
        elif self._stopped(req, said, now):
            return
        if len(req.output) >= sampling.max_new_tokens:
            self._finish(req, "length")
            return
        req.last = token

    def _stopped(self, req: GenRequest, said: int, now: float) -> bool:
        """The answer's text grew past its first ``said`` characters: emit what can no longer be part of a stop
        sequence, and finish the request when a stop sequence appeared. Stops match only after the answer's leading
        whitespace (a model that opens with a line break is not cut off) and not in text said before ``min_tokens``
        was reached."""
        text, token = req.answer_text.text, req.output[-1]
        if not req.stops or len(req.output) < req.sampling.min_tokens:
            req.stop_floor = len(text) if req.stops else 0
            req.emit(TokenEvent(token, text[req.sent:], now))
            req.sent = len(text)
            return False
        visible = len(text) - len(text.lstrip())
        start = max(req.stop_floor, visible, said - max(map(len, req.stops)) + 1)
        at = find_stop(text, req.stops, start)
        end = at if at is not None else max(req.sent, len(text) - held_back(text, req.stops, start))
        req.emit(TokenEvent(token, text[req.sent:end], now))
        req.sent = end
        if at is None:
            return False
        req.answer = text[:at]
        self._finish(req, "stop")
        return True

    def _finish(self, req: GenRequest, reason: str) -> None:
        if req.answer is None:  # no stop sequence ended it: flush what was held back (an incomplete last character
            text = self.engine.tokenizer.decode(req.output, skip_special_tokens=True)  # too, as the whole decodes it)
            streamed = req.answer_text.text
            text = text if text.startswith(streamed[:req.sent]) else streamed  # invalid bytes: see detokenize.py
            if len(text) > req.sent:
                req.emit(TokenEvent(None, text[req.sent:], time.perf_counter()))
        self._end_span(req)  # before the client hears of it: its trace is complete when the answer is
        req.ended = True
        done = DoneEvent(reason, req.sched.prompt_tokens, req.memory_tokens, len(req.output), req.first_token)
        self._free_then(req, done)

    def _fail(self, req: GenRequest, e: BaseException) -> None:
        if req.span is not None:
            req.span.record_exception(e)
        self._end_span(req)
        last, req.ended = (None if req.ended else ErrorEvent(e)), True
        self._free_then(req, last)

    def _free_then(self, req: GenRequest, last: Event | None) -> None:
        """Free ``req``, then emit its ``last`` event (if any), even when freeing raised: a client that hears its
        request ended finds it gone from the engine's counts and its slot free (the other order raced the warm-up's
        check of ``active``: 'assert 1 == 0' in a CI run)."""
        try:
            self._free(req)
        finally:
            if last is not None:
                try:
                    req.emit(last)
                except Exception:  # noqa: BLE001 - a client that cannot hear of it must not stop the others
                    log.exception("could not report the end of a request to its client")

    def _end_span(self, req: GenRequest) -> None:
        if req.span is not None:
            req.span.set_attribute("inferscale.completion_tokens", len(req.output))
            req.span.end()
            req.span = None

    # ---- slots ------------------------------------------------------------------------------------------------
    def _free(self, req: GenRequest) -> None:
        """Release ``req``'s slot, keeping rows compact: [0, decoding) decoding, then prefilling."""
        self.scheduler.finish(req.sched)
        self._end_span(req)
        if req.slot < 0:
            return
        if req.slot < self.decoding:
            self._swap(req, self.decoding - 1, keep=False)
            self.decoding -= 1
        self._swap(req, len(self.rows) - 1, keep=False)
        self.rows.pop()
        req.slot = -1
        req.blocks = []  # leased DRAM views: drop them now
        self._trim()

    def _swap(self, req: GenRequest, dst: int, keep: bool = True) -> None:
        """``req`` and the row in slot ``dst`` change places; a ``req`` that ends need not ``keep`` its K/V."""
        if req.slot == dst:
            return
        other = self.rows[dst]
        self.slots.swap(req.slot, dst, req.length if keep else 0, other.length)
        self.rows[req.slot], self.rows[dst] = other, req
        other.slot, req.slot = req.slot, dst
        self._trim()

    def _trim(self) -> None:
        """Pages the slots hold past their sequences go back once they would take the pool past the K/V budget
        (``SlotCache.trim``): called wherever such pages appear (a sequence ends or moves) or the room shrinks (an
        admission). Never inside a paused pass: its rows hold some layers' K/V of tokens past their lengths."""
        room = self.scheduler.capacity.room()  # what the budget leaves beside what the running requests may hold
        if room is not None and not self.interject.nested:
            self.slots.trim([r.length for r in self.rows], room)

