"""Stand-in of ``tensorrt_llm/llmapi/llm_args.py`` (tests only): the three settings objects the backend builds.

Fields as the pinned release names them: ``KvCacheConnectorConfig(connector_module, connector_scheduler_class,
connector_worker_class)`` (required strings), ``KvCacheConfig(enable_block_reuse, tokens_per_block,
free_gpu_memory_fraction, max_tokens)``; the connector reads ``llm_args.kv_cache_config.tokens_per_block``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KvCacheConfig:
    enable_block_reuse: bool = True
    tokens_per_block: int = 32
    free_gpu_memory_fraction: float | None = None
    max_tokens: int | None = None


@dataclass
class KvCacheConnectorConfig:
    connector_module: str
    connector_scheduler_class: str
    connector_worker_class: str


@dataclass
class TorchLlmArgs:
    model: str
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    kv_connector_config: KvCacheConnectorConfig | None = None
    max_batch_size: int | None = None  # (BaseLlmArgs.max_batch_size) the most requests its executor runs at once
