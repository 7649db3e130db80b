"""Stand-in of TensorRT-LLM's PyTorch executor around a KV-cache connector (tests only: TensorRT-LLM cannot be
installed here). It calls the connector in the order, and with the arguments, that the pinned release does
(``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py``: ``KvCacheConnectorManager`` and its output
manager; the resource manager that calls them), and keeps pages like its KV cache manager does:

  start     worker.register_kv_caches(pool)  (the single-pool case of register_kv_cache_layout)
  admit     the KV cache manager matches the prompt against the pages it holds: block reuse keyed by the tokens
            of each full page and everything before it, and by the request's cache_salt_id -> num_computed_tokens
  match     scheduler.get_num_new_matched_tokens(request, num_computed_tokens) -> (n, load_async); an answer
            (0, True) is an error, as in the manager
  allocate  pages for the whole prompt; scheduler.update_state_after_alloc(request, block_ids)
  meta      scheduler.build_connector_meta(SchedulerOutput(new_requests=[RequestData(...)])): a new request lists
            all its block ids and cache_salt; computed_position leaves out the connector's n; then
            worker.bind_connector_meta(meta)
  load      worker.start_load_kv(stream); per layer wait_for_layer_load(i, stream) / save_kv_layer(i, stream);
            worker.wait_for_save(stream); worker.get_finished(finished_gen_req_ids, started_loading_req_ids)
  forward   the prompt tokens after num_computed_tokens + n, attending to the pages (run by ``_llm``)
  finish    scheduler.request_finished(request, cache_block_ids) on finish and on abort; full prompt pages stay
            held for reuse under the request's salt id, the others are freed

``stream`` is None here (a CPU pool). None of TensorRT-LLM's code.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import RequestData, SchedulerOutput


@dataclass
class StandinRequest:
    """What the connector reads of TensorRT-LLM's ``LlmRequest``: ``request_id``, ``get_tokens(beam)`` and the
    bound ``cache_salt_id`` (the salt string itself reaches the connector only in ``RequestData``)."""

    request_id: int
    tokens: list[int]
    cache_salt: str | None = None
    cache_salt_id: int | None = None
    pages: list[int] = field(default_factory=list)
    held: int = 0  # tokens the KV cache manager already held (page aligned)
    matched: int = 0  # tokens the connector claimed after those

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)


class PagedPool:
    """The KV pool: [pages, layers, 2, H·tokens_per_block·D] as TensorRT-LLM registers it, pages reused by key."""

    def __init__(self, pages: int, layers: int, heads: int, tokens_per_block: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.tpb, self.shape = tokens_per_block, (layers, 2, heads, tokens_per_block, head_dim)
        self.tensor = torch.zeros((pages, layers, 2, heads * tokens_per_block * head_dim), dtype=dtype, device=device)
        self.pages = self.tensor.view(pages, *self.shape)
        self.free = list(range(pages))
        self.reuse: OrderedDict[tuple, int] = OrderedDict()  # (salt id, tokens up to the page's end) -> page
        self.in_use: Counter[int] = Counter()

    def _key(self, salt_id: int | None, tokens: list[int], n_pages: int) -> tuple:
        return (salt_id, tuple(tokens[: n_pages * self.tpb]))

    def match(self, salt_id: int | None, tokens: list[int]) -> list[int]:
        """Held pages for the longest run of whole pages of ``tokens`` (at least one token left to compute)."""
        held = []
        while (len(held) + 1) * self.tpb < len(tokens):
            page = self.reuse.get(self._key(salt_id, tokens, len(held) + 1))
            if page is None:
                break
            held.append(page)
        return held

    def allocate(self, n: int) -> list[int]:
        while len(self.free) < n:  # evict the oldest held page no running request uses
            victim = next((k for k, p in self.reuse.items() if not self.in_use[p]), None)
            if victim is None:
                raise RuntimeError("stand-in KV pool exhausted")
            self.free.append(self.reuse.pop(victim))
        return [self.free.pop() for _ in range(n)]

    def acquire(self, pages: list[int]) -> None:
        self.in_use.update(pages)

    def release(self, salt_id: int | None, tokens: list[int], pages: list[int]) -> None:
        """Keep the full prompt pages for reuse (a page already held under its key stays), free the rest."""
        self.in_use.subtract(pages)
        kept = set(self.reuse.values())
        for i, page in enumerate(pages):
            key = self._key(salt_id, tokens, i + 1)
            if (i + 1) * self.tpb <= len(tokens) and key not in self.reuse and page not in kept:
                self.reuse[key] = page
                kept.add(page)
            elif page not in kept and not self.in_use[page]:
                self.free.append(page)

    def read(self, pages: list[int], n: int) -> torch.Tensor:
        """Positions 0..n-1 held in ``pages`` as [layers, 2, H, n, D]."""
        m = -(-n // self.tpb)
        sel = self.pages[torch.tensor(pages[:m], dtype=torch.long)]  # [m, L, 2, H, tpb, D]
        dense = sel.permute(1, 2, 3, 0, 4, 5).reshape(*self.shape[:3], m * self.tpb, self.shape[4])
        return dense[:, :, :, :n]

    def write(self, pages: list[int], kv: torch.Tensor, start: int, end: int) -> None:
        """Positions start..end-1 of ``kv`` [layers, 2, H, >=end, D] into ``pages``."""
        for pos in range(start, end):
            self.pages[pages[pos // self.tpb], :, :, :, pos % self.tpb] = kv[:, :, :, pos].to(self.tensor.dtype)


class StandinExecutor:
    """The connector's side of one executor: admission (match, allocate, meta, load) and finish."""

    def __init__(self, scheduler, worker, pool: PagedPool, num_layers: int) -> None:
        self.scheduler, self.worker, self.pool, self.num_layers = scheduler, worker, pool, num_layers
        self.worker.register_kv_caches(pool.tensor)

    def admit(self, req: StandinRequest) -> None:
        """admit -> match -> allocate -> meta -> load for a request scheduled for the first time."""
        held = self.pool.match(req.cache_salt_id, req.tokens)
        self.pool.acquire(held)
        req.held = len(held) * self.pool.tpb
        n, load_async = self.scheduler.get_num_new_matched_tokens(req, req.held)
        if n == 0 and load_async:
            raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
        if load_async:
            raise NotImplementedError("the stand-in runs synchronous loads only")
        req.matched = n
        fresh = self.pool.allocate(-(-len(req.tokens) // self.pool.tpb) - len(held))
        self.pool.acquire(fresh)
        req.pages = held + fresh
        self.scheduler.update_state_after_alloc(req, list(req.pages))
        data = RequestData(req.request_id, list(req.tokens), list(req.pages), computed_position=req.held,
                           num_scheduled_tokens=len(req.tokens) - req.held - n, cache_salt=req.cache_salt)
        self.iterate(SchedulerOutput(new_requests=[data]))

    def iterate(self, output: SchedulerOutput) -> None:
        """One executor iteration's connector calls around the forward pass."""
        self.worker.bind_connector_meta(self.scheduler.build_connector_meta(output))
        self.worker.start_load_kv(None)
        for layer in range(self.num_layers):
            self.worker.wait_for_layer_load(layer, None)
            self.worker.save_kv_layer(layer, None)
        self.worker.wait_for_save(None)
        self.worker.get_finished([], [])
        self.worker._clear_connector_meta()

    def finish(self, req: StandinRequest) -> None:
        """On finish or abort: the scheduler hears of it, the pages go back (full prompt pages kept for reuse)."""
        if self.scheduler.request_finished(req, list(req.pages)):
            raise NotImplementedError("the stand-in does not wait for asynchronous saves")
        self.pool.release(req.cache_salt_id, req.tokens, req.pages)
