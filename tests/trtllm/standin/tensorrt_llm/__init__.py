"""Stand-in of the ``tensorrt_llm`` package (tests only: TensorRT-LLM cannot be installed on these machines).

Put ``tests/trtllm/standin`` on ``sys.path`` to make ``import tensorrt_llm`` find it. It has the pieces of the
pinned release that InferScale touches, at the same module paths: the connector ABCs
(``_torch/pyexecutor/connectors/kv_cache_connector.py``), ``llmapi.llm_args`` (``KvCacheConfig``,
``KvCacheConnectorConfig``, ``TorchLlmArgs``), ``inputs.utils.get_cache_salt_id``, and ``LLM`` /
``SamplingParams`` (``_llm``), whose executor (``_executor``) calls the connector in TensorRT-LLM's order and
runs the forward pass with the project's PyTorch model. Nothing here is TensorRT-LLM's code.
"""

from tensorrt_llm._llm import LLM, SamplingParams, register_model

STANDIN = True  # lets a test tell the stand-in from a real install

__all__ = ["LLM", "STANDIN", "SamplingParams", "register_model"]
