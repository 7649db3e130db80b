"""A request's child spans (prefill, decode) for the serving loop and the TensorRT-LLM backend alike."""

from __future__ import annotations

from typing import Any, Protocol


class TracedRequest(Protocol):
    """What a request carries for tracing (``loop.GenRequest`` has it): an OpenTelemetry tracer, duck-typed (the
    engine imports no OTel), and the request span's context."""

    tracer: Any
    context: Any


class _NoSpan:
    def set_attribute(self, *_: object) -> None: ...
    def record_exception(self, *_: object) -> None: ...
    def end(self) -> None: ...


_NO_SPAN = _NoSpan()


def request_span(req: TracedRequest, name: str, **attrs):
    """A child span of the request's own (prefill, decode), or a no-op span when the request carries no tracer."""
    if req.tracer is None:
        return _NO_SPAN
    return req.tracer.start_span(name, context=req.context, attributes=attrs)
