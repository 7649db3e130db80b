"""TensorRT-LLM integration: a KV-cache connector that fills a request's memory pages from InferScale blocks.

``core`` (span planning, page alignment, per-tenant cache salt, pool fill) and ``plans`` are plain Python and
import no ``tensorrt_llm``. ``connector`` holds the thin ``KvCacheConnectorScheduler`` / ``KvCacheConnectorWorker``
pair; TensorRT-LLM imports it by name (``KvCacheConnectorConfig(connector_module="inferscale.trtllm.connector",
...)``), so ``tensorrt_llm`` is imported only inside a TensorRT-LLM process.
"""

from inferscale.trtllm.core import BlockPlacement, SpanPlan, cache_salt, fill_pool, plan_span, pool_view, salt_allows
from inferscale.trtllm.plans import InjectionEntry, PlanRegistry, prompt_key

__all__ = ["BlockPlacement", "InjectionEntry", "PlanRegistry", "SpanPlan", "cache_salt", "fill_pool", "plan_span",
           "pool_view", "prompt_key", "salt_allows"]
