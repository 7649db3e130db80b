"""Stand-in of ``tensorrt_llm.llmapi`` (tests only)."""

from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs

__all__ = ["KvCacheConfig", "KvCacheConnectorConfig", "TorchLlmArgs"]
