"""``POST /v1/chat/completions``: retrieve the user's top-k memories, hand them to the engine worker with the
chat, and return or stream the answer. Span tree: ``chat <model>`` > retrieval, kv_fetch, prefill, decode."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from inferscale.contract import user_store_id
from inferscale.engine.loop import DoneEvent, ErrorEvent, Event, GenRequest, TokenEvent
from inferscale.engine.sampling import Sampling
from inferscale.server.auth import Tenant, require_tenant
from inferscale.server.genai_metrics import ChatTelemetry
from inferscale.server.guard import ADMISSION, Admission
from inferscale.server.httperrors import ApiError, body as error_body, from_exception, from_typed, request_id
from inferscale.server.scheduler import EventStream
from inferscale.server.schemas import (AssistantMessage, ChatCompletion, ChatCompletionRequest, Choice, ErrorBody,
                                       MemoryOptions, MemoryUsage, PromptTokensDetails, Usage)
from inferscale.errors import InferScaleError, NotFoundError

router = APIRouter(tags=["chat"])
TTFT_HEADER = "x-inferscale-ttft-ms"


def _prompt(req: ChatCompletionRequest) -> tuple[str, list[tuple[str, str]]]:
    """(retrieval query = last user message, the chat turns)."""
    turns = [(m.role if m.role != "developer" else "system", m.text()) for m in req.messages if m.role != "tool"]
    users = [t for r, t in turns if r == "user"]
    if not users or not users[-1].strip():
        raise ApiError(400, "messages: needs a user message with non-empty content", param="messages")
    return users[-1], [(r, t) for r, t in turns if t.strip()]


def _raise(err: BaseException):
    raise from_exception(err)


def _limits(req: ChatCompletionRequest, tenant: Tenant, settings) -> tuple[MemoryOptions, int, str, int]:
    """Memory options, k, mode and max tokens. A value above the tenant's limit is a bad request (400 naming the
    ``param``), not a rate limit: retrying cannot make it pass."""
    unsupported = req.unsupported()
    if unsupported is not None:
        param, why = unsupported
        raise ApiError(400, f"{param}: {why}", code="unsupported_parameter", param=param)
    opts = req.inferscale or MemoryOptions()
    k = opts.k if opts.k is not None else min(settings.default_k, tenant.max_k)
    mode = opts.mode or settings.default_mode
    # OpenAI deprecated max_tokens for max_completion_tokens: the newer one wins when both are sent.
    tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens or req.max_tokens or min(settings.default_max_tokens, tenant.max_tokens)
    if k > tenant.max_k:
        raise ApiError(400, f"inferscale.k={k} exceeds this tenant's limit of {tenant.max_k}",
                       code="k_limit_exceeded", param="inferscale.k")
    if max_tokens > tenant.max_tokens:
        raise ApiError(400, f"{tokens_param}={max_tokens} exceeds this tenant's limit of {tenant.max_tokens}",
                       code="max_tokens_limit_exceeded", param=tokens_param)
    if req.min_tokens > max_tokens:  # as vLLM refuses it: the answer could never reach it
        raise ApiError(400, f"min_tokens={req.min_tokens} exceeds {tokens_param}={max_tokens}",
                       code="min_tokens_exceeds_max_tokens", param="min_tokens")
    return opts, k, mode, max_tokens


def _owner(req: ChatCompletionRequest) -> str | None:
    """The store user id whose memories this request uses (the OpenAI ``user``, mapped by the contract's rule)."""
    return None if req.user is None else user_store_id(req.user)


@router.post("/v1/chat/completions", response_model=ChatCompletion,
             responses={s: {"model": ErrorBody} for s in (400, 401, 404, 413, 429, 503)})
async def chat_completions(req: ChatCompletionRequest, request: Request,
                           tenant: Annotated[Tenant, Depends(require_tenant)]):
    t0 = time.perf_counter()
    app = request.app.state
    settings, tel = app.settings, app.telemetry
    if req.model not in app.model_ids:
        raise ApiError(404, f"model {req.model!r} does not exist; this server serves {app.model_ids[0]!r}",
                       code="model_not_found", param="model")
    opts, k, mode, max_tokens = _limits(req, tenant, settings)
    if mode not in app.modes:
        raise ApiError(400, f"inferscale.mode {mode!r} is not available in this build (have: {', '.join(app.modes)})",
                       code="mode_unavailable", param="inferscale.mode")
    query, turns = _prompt(req)
    owner = _owner(req)
    # Characters, then tokens, before anything reaches the engine thread (one user turn: the question template,
    # the same ids as `inferscale ask`).
    prompt_ids = await app.worker.prompt_ids(turns)
    if not tenant.acquire():
        app.telemetry.metrics.rejected("in_flight")
        raise ApiError(429, f"too many requests in flight for this tenant (limit {tenant.max_in_flight})",
                       type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
    rec = ChatTelemetry(tel.tracer, tel.metrics, model=req.model, mode=mode, started=t0, request={
        "gen_ai.request.max_tokens": max_tokens, "gen_ai.request.temperature": req.temperature,
        "gen_ai.request.top_p": req.top_p, "gen_ai.request.seed": req.seed,
        "gen_ai.request.stop_sequences": list(req.stop_sequences()) if req.stop is not None else None,
        "inferscale.tenant": tenant.name, "inferscale.user": owner or "", "inferscale.k": k,
        "inferscale.stream": bool(req.stream), "inferscale.request_id": request_id(request)})
    span, ctx = rec.span, rec.context
    job = arrival = None
    handed_off = False
    try:
        # Refused here (503 + Retry-After) when this tenant's queue would outwait the timeout: before retrieval. A
        # text request counts its k memories too: announced at its question's tokens alone, a flood of long text
        # requests was refused only once retrieved, up to 1.8 s after it was sent (issue 22).
        announced = len(prompt_ids)
        if mode == "text" and owner is not None:
            announced += await app.memories.text_tokens(tenant.name, owner, k)
        arrival = app.worker.expect(tenant.name, announced, mode if owner is not None else "none", max_tokens)
        blocks, recompute_ids, chosen = [], [], []
        if mode != "none" and owner is not None:
            # Only kv mode weighs fetching a block against recomputing it (the others need every block's KV or text).
            rate = app.worker.prompt_token_s if mode == "kv" else None
            try:
                planned, chosen = await app.memories.retrieve(tenant.name, owner, query, k, tel.tracer, ctx, rate)
                blocks, recompute_ids = planned.blocks, planned.recompute_ids
            except NotFoundError:  # no memories yet (every user's first conversation): answer with none
                blocks, recompute_ids, chosen = [], [], []
        effective_mode = mode if owner is not None else "none"
        rec.set_mode(effective_mode)
        sampling = Sampling(max_new_tokens=max_tokens, temperature=req.temperature or 0.0,
                            top_p=req.top_p if req.top_p is not None else 1.0, seed=req.seed,
                            stop=req.stop_sequences(), ignore_eos=req.ignore_eos,
                            min_tokens=req.min_tokens)
        job = EventStream()
        job.request = GenRequest(
            ids=prompt_ids, blocks=blocks, mode=effective_mode, sampling=sampling, emit=job.emit, tenant=tenant.name,
            tracer=tel.tracer, context=ctx, recompute_ids=recompute_ids,
            recompute_ratio=opts.recompute_ratio if opts.recompute_ratio is not None else settings.recompute_ratio)
        blocks = None  # the request holds them until it is done
        arrival.close()  # from here on it counts in the queue itself
        app.worker.submit(job.request)
        first = await job.next()
        while isinstance(first, TokenEvent) and not first.text:  # nothing visible yet (a partial character)
            first = await job.next()
        if isinstance(first, ErrorEvent):
            _raise(first.error)
        ttft = rec.first_token(first.t if isinstance(first, TokenEvent) else None)
        span.set_attribute("inferscale.retrieved", len(chosen))
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        meta = MemoryUsage(mode=effective_mode, k=k, items=chosen, memory_tokens=0, ttft_ms=round(ttft * 1000, 3))
        headers = {TTFT_HEADER: f"{ttft * 1000:.3f}"}
        if req.stream:
            handed_off = True
            gen = _stream(job, first, rid, req, meta, rec, _Slots(tenant, getattr(request.state, ADMISSION, None)))
            return StreamingResponse(gen, media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"})
        text, done = await _collect(job, first)
        reason = done.finish_reason
        meta.memory_tokens = done.memory_tokens
        usage = _usage(done, effective_mode)
        _finish(rec, rid, req.model, usage, meta.memory_tokens, reason)
        out = ChatCompletion(id=rid, created=int(time.time()), model=req.model, usage=usage, inferscale=meta,
                             choices=[Choice(message=AssistantMessage(content=text.strip()), finish_reason=reason)])
        return JSONResponse(out.model_dump(), headers=headers)
    except BaseException as e:
        if job is not None:
            job.cancel()
        rec.fail(from_typed(e) if isinstance(e, InferScaleError) else e)  # error.type = the status it answers
        raise
    finally:
        if arrival is not None:
            arrival.close()
        if not handed_off:
            tenant.release()
            rec.end()


async def _collect(job: EventStream, first: Event) -> tuple[str, DoneEvent]:
    parts: list[str] = []
    ev = first
    while True:
        if isinstance(ev, TokenEvent):
            parts.append(ev.text)
        elif isinstance(ev, DoneEvent):
            return "".join(parts), ev
        else:
            _raise(ev.error)
        ev = await job.next()


# Modes whose memory tokens arrive as cached KV (reported as OpenAI's cached prompt tokens); text mode computes them.
CACHED_MODES = ("kv", "kv-recompute")


def _usage(done: DoneEvent, mode: str) -> Usage:
    cached = done.memory_tokens if mode in CACHED_MODES else 0
    return Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                 total_tokens=done.prompt_tokens + done.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _finish(rec: ChatTelemetry, rid: str, model: str, usage: Usage, memory_tokens: int, reason: str) -> None:
    rec.finish(response_id=rid, model=model, prompt_tokens=usage.prompt_tokens,
               completion_tokens=usage.completion_tokens, memory_tokens=memory_tokens, finish_reasons=[reason])


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Slots:
    """A streamed answer's in-flight slots, the engine's (``Tenant.acquire``) and the guard's (``Admission``), given
    back once: before the stream's last line, so a client that reads ``[DONE]`` and sends its next request at once
    finds them free."""

    def __init__(self, tenant: Tenant, admission: Admission | None) -> None:
        self._tenant, self._admission = tenant, admission

    def release(self) -> None:
        tenant, self._tenant = self._tenant, None
        if tenant is not None:
            tenant.release()
        if self._admission is not None:
            self._admission.leave()


async def _stream(job: EventStream, first: Event, rid: str, req: ChatCompletionRequest, meta: MemoryUsage,
                  rec: ChatTelemetry, slots: _Slots):
    created = int(time.time())
    # With include_usage every chunk carries "usage": null but the last one, which carries only the usage.
    with_usage = req.stream_options is not None and req.stream_options.include_usage
    nulls = {"usage": None} if with_usage else {}

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                     **nulls, **extra})

    try:
        yield chunk({"role": "assistant", "content": ""})
        ev = first
        while True:
            if isinstance(ev, TokenEvent):
                if ev.text:
                    yield chunk({"content": ev.text})
            elif isinstance(ev, DoneEvent):
                usage = _usage(ev, meta.mode)
                meta.memory_tokens = ev.memory_tokens
                _finish(rec, rid, req.model, usage, meta.memory_tokens, ev.finish_reason)
                yield chunk({}, ev.finish_reason, inferscale=meta.model_dump())
                if with_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                                "choices": [], "usage": usage.model_dump()})
                break
            else:  # an error after the first token: report it in-band, as OpenAI does
                a = from_exception(ev.error)
                rec.fail(a, message=a.message)
                yield _sse(error_body(a.message, a.type, a.code, a.param))
                break
            ev = await job.next()
        slots.release()
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # no-op when finished; stops decoding when the client went away
        slots.release()
        rec.end()
