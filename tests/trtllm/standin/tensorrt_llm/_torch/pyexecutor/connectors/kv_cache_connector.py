"""Stand-in of TensorRT-LLM's connector API module (tests only; TensorRT-LLM cannot be installed here).

Same module path, class names, constructors and abstract methods as the pinned release's
``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` (see ``PINNED`` in
``tests/trtllm/test_connector_contract.py``, which checks this file against the recorded signatures too), written
from that source: the worker keeps the scheduler's metadata in ``_metadata`` (``bind_connector_meta``), the
scheduler and worker take ``llm_args``, ``RequestData`` carries ``cache_salt``. None of TensorRT-LLM's code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class RequestData:
    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int
    block_hashes: list[int] = field(default_factory=list)
    priorities: list[int] | None = None
    cache_salt: str | None = None
    new_block_ids_by_layer_group: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)
    attention_dp_rank: int | None = None


class KvCacheConnectorWorker(ABC):
    def __init__(self, llm_args):
        self._llm_args = llm_args
        self._metadata = None

    def bind_connector_meta(self, metadata: object):
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self):
        self._metadata = None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor): ...

    @abstractmethod
    def start_load_kv(self, stream): ...

    @abstractmethod
    def wait_for_layer_load(self, layer_idx, stream): ...

    @abstractmethod
    def save_kv_layer(self, layer_idx, stream): ...

    @abstractmethod
    def wait_for_save(self, stream): ...

    @abstractmethod
    def get_finished(self, finished_gen_req_ids, started_loading_req_ids): ...


class KvCacheConnectorScheduler(ABC):
    def __init__(self, llm_args):
        self._llm_args = llm_args

    @abstractmethod
    def build_connector_meta(self, scheduler_output): ...

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...

    @abstractmethod
    def request_finished(self, request, cache_block_ids): ...

    @abstractmethod
    def update_state_after_alloc(self, request, block_ids): ...
