"""Request and response bodies: the OpenAI chat-completions schema, plus the ``inferscale`` extension object."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StringConstraints, field_validator,
                      model_validator)

from inferscale.contract import ID_PATTERN, TENANT_PATTERN, TTFT_GRANULARITY_MS, USER_MAX_LEN, Mode
from inferscale.engine.sampling import MAX_STOP, MAX_TEMPERATURE, SEED_MAX, SEED_MIN

_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")  # JSON "\\ud800" parses to one; it has no UTF-8 form


def lone_surrogate_at(value: Any, where: str = "") -> str | None:
    """The path of the first string in ``value`` (JSON-shaped) holding a lone surrogate, else None."""
    if isinstance(value, str):
        m = _LONE_SURROGATE.search(value)
        return f"{where or 'body'} (U+{ord(m.group()):04X} at character {m.start()})" if m else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = lone_surrogate_at(k, where) if isinstance(k, str) else None
        found = found or lone_surrogate_at(v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}".lstrip("."))
        if found:
            return found
    return None


class NoLoneSurrogates(BaseModel):
    """A request body whose strings are all encodable text: a lone surrogate is a 400 naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where:
            raise ValueError(f"{where}: a lone surrogate is not text; send a valid pair or UTF-8")
        return data



def _no_dotdot(value: str) -> str:
    if ".." in value:
        raise ValueError("must not contain '..'")
    return value


ItemId = Annotated[str, StringConstraints(pattern=ID_PATTERN), AfterValidator(_no_dotdot)]
UserId = Annotated[str, StringConstraints(pattern=ID_PATTERN), AfterValidator(_no_dotdot)]
# The OpenAI ``user`` (any string; inferscale.contract.user_store_id maps it to the store's user id).
ApiUser = Annotated[str, StringConstraints(min_length=1, max_length=USER_MAX_LEN)]
StopText = Annotated[str, StringConstraints(min_length=1, max_length=256)]
TenantName = Annotated[str, StringConstraints(pattern=TENANT_PATTERN)]
# host:port of a peer's NIXL agent; an absolute path on the node (both checked again where used: the store's
# address check, jobpaths' normalized-path check, which the document cannot say all of)
PeerAddress = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9.\-\[\]:]{1,255}:[0-9]{1,5}$")]
NodePath = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^/")]
HARD_MAX_K = 1000
MAX_MESSAGES = 10_000  # turns of one chat: far more than any context holds, and a bound on validation work


# ---- errors -------------------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


# ---- chat completions ---------------------------------------------------------------------------------------
class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... are accepted and ignored
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class MemoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    k: int | None = Field(None, ge=0, le=HARD_MAX_K, description="memories to retrieve (top-k by cosine similarity)")
    mode: Mode | None = Field(
        None, description="kv: inject cached KV; text: paste memories into the prompt; none: no memories"
    )
    recompute_ratio: float | None = Field(None, ge=0.0, le=1.0, description="kv-recompute: fraction of tokens re-run")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatCompletionRequest(NoLoneSurrogates):
    """OpenAI's request body. An unknown field is refused (400 "Unrecognized request argument", as OpenAI does);
    a known one this server cannot honour is refused by ``unsupported()`` (400 naming the ``param``). NaN and
    infinities (JSON's ``NaN``, ``Infinity``, which Python's parser takes) are refused as not finite, not as out of
    range."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI: max_completion_tokens wins")
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE, description=(
        "below 1e-5: greedy; below 0.01: raised to 0.01 (vLLM's floors: a smaller one overflows the logits)"))
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="a 64-bit signed integer, as vLLM takes")
    n: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = Field(
        None, description="up to 4 sequences; replaces the model's default stop (see GET /v1/models)")
    user: ApiUser | None = Field(None, description="whose memories to use (scoped to the caller's tenant); any "
                                 "string, mapped to a store id by inferscale.contract.user_store_id")
    safety_identifier: ApiUser | None = Field(None, description="accepted; not acted on")
    prompt_cache_key: str | None = Field(None, max_length=1024, description="accepted; caching is by memory")
    metadata: dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(
        max_length=512)]] | None = Field(None, max_length=16, description="accepted; recorded nowhere")
    service_tier: Literal["auto", "default"] | None = None
    store: StrictBool | None = None
    # Known OpenAI fields this server cannot honour: typed here so that a harmless value passes and any other
    # answers 400 with ``param`` (see unsupported()).
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI's ranges, then refused unless harmless
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    inferscale: MemoryOptions | None = None
    # vLLM's extra sampling parameters (send them in the openai client's extra_body): force the output length.
    ignore_eos: StrictBool = Field(False, description="keep generating past end-of-sequence and the default stop")
    min_tokens: int = Field(0, ge=0, description="no stop ends the answer before this many tokens")

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for the first field whose value this server cannot honour, else None."""
        checks: list[tuple[str, bool, str]] = [
            ("logprobs", bool(self.logprobs), "log probabilities are not returned by this server"),
            ("top_logprobs", bool(self.top_logprobs), "log probabilities are not returned by this server"),
            ("frequency_penalty", bool(self.frequency_penalty), "only 0 is supported"),
            ("presence_penalty", bool(self.presence_penalty), "only 0 is supported"),
            ("logit_bias", bool(self.logit_bias), "logit bias is not supported"),
            ("response_format", self.response_format is not None and self.response_format.type != "text",
             "only {\"type\": \"text\"} is supported"),
            ("tools", bool(self.tools), "tool calling is not supported"),
            ("tool_choice", self.tool_choice not in (None, "none"), "tool calling is not supported"),
            ("parallel_tool_calls", self.parallel_tool_calls is not None, "tool calling is not supported"),
            ("functions", bool(self.functions), "function calling is not supported"),
            ("function_call", self.function_call not in (None, "none"), "function calling is not supported"),
            ("audio", self.audio is not None, "audio output is not supported"),
            ("modalities", any(m != "text" for m in self.modalities or []), "only the text modality is supported"),
            ("prediction", self.prediction is not None, "predicted outputs are not supported"),
            ("reasoning_effort", self.reasoning_effort is not None, "this model does not reason"),
            ("verbosity", self.verbosity is not None, "verbosity is not supported"),
            ("web_search_options", self.web_search_options is not None, "web search is not supported"),
            ("store", bool(self.store), "stored completions are not supported"),
        ]
        return next(((param, why) for param, bad, why in checks if bad), None)

    def stop_sequences(self) -> tuple[str, ...] | None:
        """The request's stop sequences; None: the model's default."""
        if self.stop is None:
            return None
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="memory tokens injected as cached KV (kv modes); 0 otherwise")


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class MemoryUsage(BaseModel):
    mode: str
    k: int
    items: list[str]
    memory_tokens: int
    ttft_ms: float

    @field_validator("ttft_ms")
    @classmethod
    def _coarse(cls, v: float) -> float:  # the granularity the tenant API reports (server/guard.py)
        return float(-(-max(0.0, v) // TTFT_GRANULARITY_MS) * TTFT_GRANULARITY_MS)


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    inferscale: MemoryUsage | None = None


class ModelProfile(BaseModel):
    default_stop: list[str] = Field(description="stop sequences in force when a request sends no `stop`")
    modes: list[str]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inferscale"
    inferscale: ModelProfile | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- memories -----------------------------------------------------------------------------------------------
class MemoryItemIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: ItemId
    text: Annotated[str, StringConstraints(min_length=1, max_length=8192, pattern=r"\S")]
    timestamp: str | None = Field(None, max_length=64)


class PutMemories(NoLoneSurrogates):
    model_config = ConfigDict(extra="forbid")
    items: list[MemoryItemIn] = Field(..., min_length=1, max_length=10000, description=(
        "ids unique within one request: a repeated id is refused (400 duplicate_id), not resolved by order"))
    replace: StrictBool = Field(False, description="also delete the user's items that are not in this list")


class PutMemoriesResult(BaseModel):
    user: str
    encoded: int
    removed: int
    bytes: int
    seconds: float


class MemoryInfo(BaseModel):
    id: str
    text: str | None = None
    timestamp: str | None = None
    tokens: int | None = None
    bytes: int | None = None


class MemoryList(BaseModel):
    user: str
    items: list[MemoryInfo]


class Removed(BaseModel):
    removed_blocks: int
    removed_bytes: int = 0


# ---- internal (operator -> pod), docs/interfaces.md -----------------------------------------------------------
class PullSource(BaseModel):
    node: str = Field(..., max_length=253)
    # A Job's output dir on this node (the CLI/dev path; inferscale/jobpaths.py): the chart's Jobs deliver instead.
    dir: NodePath | None = None
    peer: PeerAddress | None = Field(None, description="host:port of the peer's NIXL agent")


class PullRequest(BaseModel):
    tenant: TenantName
    user: UserId
    source: PullSource
    items: list[ItemId] | None = None


class PullResult(BaseModel):
    """The user's totals on this pod after the pull."""
    tenant: str
    user: str
    blocks: int
    bytes: int
    tier: Literal["dram", "gpu"]
    tokens: int | None = None


class PurgeRequest(BaseModel):
    tenant: TenantName
    user: UserId
    items: list[ItemId] | None = None
    source_dir: NodePath | None = Field(None, description=(
        "also delete this encoding-Job output dir on this node: <INFERSCALE_KV_HOST_PATH>/<tenant>/<user>"))


class Purged(Removed):
    """``source_dir_removed`` only when the request named a ``source_dir``: whether this call deleted it (false: it
    was not there)."""
    source_dir_removed: bool | None = None


class Capacity(BaseModel):
    node: str
    pod: str
    bytes_used: int
    bytes_capacity: int
    users: int


# Every model above: the served OpenAPI document's integer bounds are read back from them (server/openapi.py).
MODELS = tuple(v for v in list(globals().values())
               if isinstance(v, type) and issubclass(v, BaseModel) and v.__module__ == __name__)
