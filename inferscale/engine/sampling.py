"""Sampling settings and the sampler, shared by every client of the serving loop."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from inferscale.errors import ConfigError


@dataclass
class Sampling:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_on_newline: bool = True  # short answers: a line break ends them, once some visible text was said
    ignore_eos: bool = False  # vLLM's extra parameter: generate exactly max_new_tokens (load benchmarks)
    min_tokens: int = 0  # vLLM's extra parameter: stop tokens cannot be chosen before this many tokens

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: expected 1 or more")
        if self.min_tokens < 0:
            raise ConfigError(f"min_tokens={self.min_tokens}: expected 0 or more")


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None,
           banned: Collection[int] = ()) -> int:
    """One token from ``logits`` [vocab] (float32); ``banned`` ids are never chosen."""
    if banned:
        logits = logits.clone()
        logits[list(banned)] = float("-inf")
    if sampling.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < sampling.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
