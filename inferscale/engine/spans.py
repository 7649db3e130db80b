"""A request's child spans (prefill, decode) for the serving loop and the TensorRT-LLM backend alike."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer


class TracedRequest(Protocol):
    """What a request carries for tracing (``loop.GenRequest`` has it): an OpenTelemetry tracer (the engine imports
    no OTel at run time: the server hands its own in) and the request span's context."""

    tracer: Tracer | None
    context: Context | None


class RequestSpan(Protocol):
    """What the engine does with a phase's span: an OpenTelemetry span, or a no-op one without a tracer."""

    def set_attribute(self, key: str, value: bool | int | float | str, /) -> None: ...
    def record_exception(self, exception: BaseException, /) -> None: ...
    def end(self) -> None: ...


class _NoSpan:
    def set_attribute(self, *_: object) -> None: ...
    def record_exception(self, *_: object) -> None: ...
    def end(self) -> None: ...


_NO_SPAN = _NoSpan()


def request_span(req: TracedRequest, name: str, **attrs: bool | int | float | str) -> RequestSpan:
    """A child span of the request's own (prefill, decode), or a no-op span when the request carries no tracer."""
    if req.tracer is None:
        return _NO_SPAN
    return req.tracer.start_span(name, context=req.context, attributes=attrs)
