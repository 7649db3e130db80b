"""What a pass's rows choose their next token from: the argmax, or logits to sample (issue 22).

A greedy row needs only the argmax of its logits, which the LM head's int8 screen gives without reading the bf16
head (``models/greedyhead.py``); logits are computed only where a row samples, keeps its first token's logits, or
has stop tokens banned (before ``min_tokens``) and the argmax is one of them. When the argmax is not banned it is
also the first maximum of the tokens the row may choose, so ``min_tokens`` (aiperf's and vLLM's way to force an
answer's length, with ``ignore_eos``) keeps the screen. The serving loop asks these rules; no model here.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

import torch

from inferscale.engine.sampling import Sampling
from inferscale.models.greedyhead import Head, first_max


class GenRequest(Protocol):
    """What these rules read of a request (``loop.GenRequest`` has it)."""

    sampling: Sampling
    output: list[int]
    keep_first_logits: bool
    first_token: int | None


def banned(req: GenRequest, stop_ids: Collection[int]) -> Collection[int]:
    """Tokens ``req`` may not choose now: the stop tokens, until ``min_tokens`` were said."""
    return stop_ids if len(req.output) < req.sampling.min_tokens else ()


def greedy(req: GenRequest) -> bool:
    """Whether ``req`` decodes greedily: its next token is the first maximum of the logits it may choose."""
    return req.sampling.temperature <= 0


def decides(req: GenRequest, token: int, stop_ids: Collection[int]) -> bool:
    """Whether ``token``, the first maximum of all the logits, is ``req``'s next token: greedy and not banned now
    (then no token it may choose scores higher, nor as high before it)."""
    return greedy(req) and token not in banned(req, stop_ids)


def needs_logits(req: GenRequest) -> bool:
    """``req``'s next token is drawn from its logits, or its first token's logits are to be kept."""
    return not greedy(req) or (req.keep_first_logits and req.first_token is None)


def choices(head: Head, deciding: list[GenRequest],
            stop_ids: Collection[int]) -> list[tuple[torch.Tensor | None, int]]:
    """Each row of ``head``'s logits (None where the LM head's screen answered without them) and its argmax.
    Only tokens are needed when every request ``deciding`` a token from it takes the argmax (``decides``): the head
    may then be screened. Else one argmax over the batch's logits serves every greedy row (``greedyhead.first_max``:
    no per-row fp32 copy of the vocabulary, the first maximum as ``max(dim).indices`` gives it), and a row whose
    argmax is banned samples from its logits."""
    if not any(needs_logits(r) for r in deciding):
        tokens = head.argmax()
        if all(decides(r, t, stop_ids) for r, t in zip(deciding, tokens)):
            return list(zip(head.computed if head.computed is not None else [None] * len(tokens), tokens))
    logits = head.logits()
    return list(zip(logits, first_max(logits)))
