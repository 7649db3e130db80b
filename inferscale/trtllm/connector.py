"""The thin TensorRT-LLM adapter: ``KvCacheConnectorScheduler`` / ``KvCacheConnectorWorker`` for the PyTorch backend.

TensorRT-LLM imports this module by name, inside its executor process:

    KvCacheConnectorConfig(connector_module="inferscale.trtllm.connector",
                           connector_scheduler_class="InferScaleConnectorScheduler",
                           connector_worker_class="InferScaleConnectorWorker")
    llm.generate_async(prompt_ids, params, cache_salt=inferscale.trtllm.cache_salt(secret, tenant))

so the ``tensorrt_llm`` import below runs only there (``import inferscale.trtllm`` never loads this file). The
serving side (``inferscale.trtllm.backend``) writes each request's plan to ``INFERSCALE_TRTLLM_PLAN_DIR``
(``plans.PlanRegistry``) before it submits the prompt. Everything with logic in it is in ``core`` and ``plans``;
this file maps TensorRT-LLM's calls onto them. The API it implements is pinned in
``tests/trtllm/test_connector_contract.py`` (release, file, every abstract method's signature, read from
TensorRT-LLM's source); ``tests/trtllm/standin`` drives it through TensorRT-LLM's call sequence on CPU.

The salt, twice: at match time TensorRT-LLM hands over the request's ``cache_salt_id`` (its 64-bit hash of the
salt), checked against the plan's salt hashed the same way; when the request is first scheduled,
``RequestData.cache_salt`` (the salt string itself, in the pinned release) must equal the plan's. A load refused
then, or one whose plan vanished, cannot be un-matched: its pages are zeroed and the request is marked failed in
the plan directory, which the serving side turns into an error for that request only.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import os
from dataclasses import dataclass, field

import torch

from inferscale.trtllm.core import fill_pool, plan_span, pool_view, salt_allows, zero_pages
from inferscale.trtllm.plans import PlanRegistry, prompt_key

# Where the connector ABCs live: the pinned release first, then the earlier release we also support.
ABC_MODULES = (
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
)
SALT_ID_MODULE = "tensorrt_llm.inputs.utils"  # get_cache_salt_id(cache_salt: str) -> int
PLAN_DIR_ENV = "INFERSCALE_TRTLLM_PLAN_DIR"
TRACE_ENV = "INFERSCALE_TRTLLM_TRACE"  # optional file: one line per fill, so a check can see the connector act


def _connector_abcs():
    """The first of ABC_MODULES that imports. A module missing *inside* one (a broken install) is not hidden."""
    for name in ABC_MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not (e.name and name.startswith(e.name)):
                raise
    raise ImportError(f"no TensorRT-LLM KV-cache connector API here (looked for {', '.join(ABC_MODULES)})")


_abcs = _connector_abcs()  # lazy: only TensorRT-LLM's process imports this module
KvCacheConnectorScheduler = _abcs.KvCacheConnectorScheduler
KvCacheConnectorWorker = _abcs.KvCacheConnectorWorker
SchedulerOutput = _abcs.SchedulerOutput


@dataclass
class LoadOrder:
    key: str  # the plan's prompt key
    question_len: int
    page_table: list[int]  # the request's pages, in sequence order
    start: int  # first position to fill (what TensorRT-LLM already held)
    end: int  # one past the last position to fill (page aligned)
    salt: str = ""  # the plan's salt, checked against RequestData.cache_salt
    refused: str = ""  # why the pages are zeroed instead of filled ("" = fill them)


@dataclass
class InferScaleConnectorMeta:
    loads: list[LoadOrder] = field(default_factory=list)


def _registry() -> PlanRegistry:
    return PlanRegistry(os.environ[PLAN_DIR_ENV])


class InferScaleConnectorScheduler(KvCacheConnectorScheduler):
    """Claims the page-aligned [prefix][memory span] of a request that has a plan; loads synchronously."""

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self.tokens_per_block = int(llm_args.kv_cache_config.tokens_per_block)
        self.registry = _registry()
        self.pending: dict[int, LoadOrder] = {}
        self.salt_id = importlib.import_module(SALT_ID_MODULE).get_cache_salt_id  # TensorRT-LLM's salt -> id

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = list(request.get_tokens(0))
        salt_id = getattr(request, "cache_salt_id", None)
        entry = self.registry.get(tokens, salt_id)  # plans are keyed by the tokens and the salt id
        if entry is None or not salt_allows(entry.salt, salt_id, self.salt_id):
            self.pending.pop(request.request_id, None)
            return 0, False
        memory_end = entry.prefix_kv.shape[3] + sum(n for n, _ in entry.blocks)
        if len(tokens) <= memory_end:  # no question after the memories: not a prompt this plan was made for
            return 0, False
        plan = plan_span(entry.prefix_kv.shape[3], entry.blocks, len(tokens) - memory_end, self.tokens_per_block)
        n = plan.num_new_matched_tokens(num_computed_tokens)
        if n:
            self.pending[request.request_id] = LoadOrder(prompt_key(tokens, salt_id), plan.question_len, [],
                                                         num_computed_tokens, num_computed_tokens + n, entry.salt)
        else:
            self.pending.pop(request.request_id, None)
        return n, False

    def update_state_after_alloc(self, request, block_ids: list[int]) -> None:
        if request.request_id in self.pending:
            self.pending[request.request_id].page_table = list(block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> InferScaleConnectorMeta:
        meta = InferScaleConnectorMeta()
        for req in scheduler_output.new_requests:
            order = self.pending.pop(req.request_id, None)
            if order is None:
                continue
            order.page_table = list(req.new_block_ids) or order.page_table  # a new request lists all its pages
            salt = getattr(req, "cache_salt", None)  # the pinned release reports it; the earlier one does not
            if salt is not None and not hmac.compare_digest(str(salt), order.salt):
                order.refused = "salt"
            meta.loads.append(order)
        return meta

    def request_finished(self, request, cache_block_ids: list[int]) -> bool:
        self.pending.pop(request.request_id, None)
        return False  # nothing is saved asynchronously


class InferScaleConnectorWorker(KvCacheConnectorWorker):
    """Fills the ordered pages with the fused kernel before the forward pass; saves nothing."""

    def __init__(self, llm_args) -> None:
        super().__init__(llm_args)
        self.tokens_per_block = int(llm_args.kv_cache_config.tokens_per_block)
        self.registry = _registry()
        self.kv_cache_tensor: torch.Tensor | None = None

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        self.kv_cache_tensor = kv_cache_tensor

    def start_load_kv(self, stream) -> None:
        meta = self._metadata
        if not meta or not meta.loads:
            return
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():  # None: a CPU pool
            for order in meta.loads:
                self._load(order)

    def _load(self, order: LoadOrder) -> None:
        entry = None if order.refused else self.registry.load(order.key)
        if entry is None:  # refused, or the server withdrew the plan: never leave stale pages to be attended to
            zero_pages(self.kv_cache_tensor, order.page_table, order.start, order.end, self.tokens_per_block)
            self.registry.mark_failed(order.key, order.refused or "vanished")
            return
        heads, head_dim = entry.prefix_kv.shape[2], entry.prefix_kv.shape[4]
        pool = pool_view(self.kv_cache_tensor, heads, head_dim, self.tokens_per_block)
        plan = plan_span(entry.prefix_kv.shape[3], entry.blocks, order.question_len, self.tokens_per_block)
        fill_pool(pool, order.page_table, plan, entry.prefix_kv, entry.block_kvs, entry.groups,
                  order.start, order.end)
        if os.environ.get(TRACE_ENV):
            with open(os.environ[TRACE_ENV], "a") as trace:
                trace.write(f"filled {order.key} {order.start} {order.end}\n")

    def wait_for_layer_load(self, layer_idx: int, stream) -> None:
        pass  # start_load_kv fills every layer on the forward stream before the forward pass is enqueued

    def save_kv_layer(self, layer_idx: int, stream) -> None:
        pass

    def wait_for_save(self, stream) -> None:
        pass

    def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]):
        return [], []
