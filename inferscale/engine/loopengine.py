"""What the serving loop (inferscale/engine/loop.py) reads of the engine that drives it: a typed seam, so the loop
does not import the engine module that builds it (``Engine`` satisfies it structurally)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only; none of these modules imports this one
    import torch

    from inferscale.engine.template import PromptTemplate
    from inferscale.kvformat import KVBlock
    from inferscale.models.loader import LoadedModel


class LoopEngine(Protocol):
    loaded: LoadedModel
    template: PromptTemplate
    prefix_ids: list[int]
    prefix_kv: torch.Tensor  # the shared prompt prefix's KV, [L, 2, H, P, D]
    stop_ids: set[int]
    tokenizer: object  # the loaded model's (transformers) tokenizer, as ``LoadedModel`` holds it

    @property
    def device(self) -> torch.device:
        """Where the model runs."""

    def check_block(self, block: KVBlock, source: str = "block") -> None:
        """Raise a typed error unless ``block`` was encoded for this model and prefix."""
