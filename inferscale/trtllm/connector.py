"""The thin TensorRT-LLM adapter: ``KvCacheConnectorScheduler`` / ``KvCacheConnectorWorker`` for the PyTorch backend.

TensorRT-LLM imports this module by name, inside its own process:

    KvCacheConnectorConfig(connector_module="inferscale.trtllm.connector",
                           connector_scheduler_class="InferScaleConnectorScheduler",
                           connector_worker_class="InferScaleConnectorWorker")
    llm.generate(prompt_ids, params, cache_salt=inferscale.trtllm.cache_salt(secret, tenant))

so the ``tensorrt_llm`` import below runs only there (``import inferscale.trtllm`` never loads this file). The
serving side writes each request's plan to ``INFERSCALE_TRTLLM_PLAN_DIR`` (``plans.PlanRegistry``) before it
submits the prompt. Everything with logic in it is in ``core`` and ``plans`` and tested on CPU; this file maps
TensorRT-LLM's calls onto them and is exercised by ``scripts/gpu-check.sh`` where TensorRT-LLM is installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (  # lazy: only TensorRT-LLM imports this module
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    SchedulerOutput,
)

from inferscale.trtllm.core import fill_pool, plan_span, pool_view, salt_allows
from inferscale.trtllm.plans import PlanRegistry, prompt_key

PLAN_DIR_ENV = "INFERSCALE_TRTLLM_PLAN_DIR"
TRACE_ENV = "INFERSCALE_TRTLLM_TRACE"  # optional file: one line per fill, so a check can see the connector act


@dataclass
class LoadOrder:
    key: str  # the plan's prompt key
    question_len: int
    page_table: list[int]  # the request's pages, in sequence order
    start: int  # first position to fill (what TensorRT-LLM already held)
    end: int  # one past the last position to fill (page aligned)


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
        from tensorrt_llm.inputs import get_cache_salt_id  # how TensorRT-LLM turns a cache_salt into the id

        self.salt_id = get_cache_salt_id

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = list(request.get_tokens(0))
        entry = self.registry.get(tokens)
        if entry is None or not salt_allows(entry.salt, getattr(request, "cache_salt_id", None), self.salt_id):
            return 0, False
        memory_end = entry.prefix_kv.shape[3] + sum(n for n, _ in entry.blocks)
        if len(tokens) <= memory_end:  # no question after the memories: not a prompt this plan was made for
            return 0, False
        plan = plan_span(entry.prefix_kv.shape[3], entry.blocks, len(tokens) - memory_end, self.tokens_per_block)
        n = plan.num_new_matched_tokens(num_computed_tokens)
        if n:
            self.pending[request.request_id] = LoadOrder(prompt_key(tokens), plan.question_len, [],
                                                         num_computed_tokens, num_computed_tokens + n)
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
            if order is not None:
                order.page_table = list(req.new_block_ids) or order.page_table  # a new request lists all its pages
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
        with torch.cuda.stream(stream):
            for order in meta.loads:
                entry = self.registry.load(order.key)
                if entry is None:  # the server withdrew it; TensorRT-LLM would read unfilled pages
                    raise RuntimeError(f"inferscale connector: plan {order.key[:12]} vanished before its load")
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
