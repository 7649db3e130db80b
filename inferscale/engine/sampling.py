"""Sampling settings and the sampler, shared by every client of the serving loop."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from inferscale.errors import InvalidInputError

MAX_STOP = 4  # stop sequences per request, as OpenAI allows
# Seeds are 64-bit signed integers, as vLLM's API takes them; torch.Generator.manual_seed maps a negative one to
# 2**64 + seed. A seed outside is refused (a 400 naming ``seed``), never reduced.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# vLLM's floors: below GREEDY_BELOW a temperature means greedy decoding; up to MIN_TEMPERATURE it is raised to
# MIN_TEMPERATURE. Logits divided by a smaller one overflow float32 (1e-300 made every probability inf/nan).
GREEDY_BELOW = 1e-5
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0  # OpenAI's range is 0 to 2


@dataclass
class Sampling:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    # Stop sequences, matched on the decoded text (across token boundaries) once visible text was said; the match
    # and what follows it are not returned. None: the model profile's default (PromptTemplate.default_stop);
    # (): none. With ignore_eos the profile's default is off too (a request's own stop still applies, as in vLLM).
    stop: tuple[str, ...] | None = None
    ignore_eos: bool = False  # vLLM's extra parameter: generate exactly max_new_tokens (load benchmarks)
    min_tokens: int = 0  # vLLM's extra parameter: no stop (token or sequence) ends the answer before this many tokens

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens={self.max_new_tokens}: expected 1 or more", param="max_tokens")
        if self.min_tokens < 0:
            raise InvalidInputError(f"min_tokens={self.min_tokens}: expected 0 or more", param="min_tokens")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidInputError(f"seed={self.seed}: expected a 64-bit signed integer", param="seed")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:  # False for NaN too
            raise InvalidInputError(f"temperature={self.temperature}: expected 0 to {MAX_TEMPERATURE:g}",
                                    param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"top_p={self.top_p}: expected more than 0, at most 1", param="top_p")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        elif self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = (self.stop,)
            self.stop = tuple(self.stop)
            if len(self.stop) > MAX_STOP or not all(isinstance(s, str) and s for s in self.stop):
                raise InvalidInputError(f"stop: expected up to {MAX_STOP} non-empty strings", param="stop")

    def stops(self, default: tuple[str, ...]) -> tuple[str, ...]:
        """The stop sequences in force: the request's own, else the profile's ``default`` (none with ignore_eos)."""
        if self.stop is not None:
            return self.stop
        return () if self.ignore_eos else default


def find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Where the earliest stop sequence begins in ``text[start:]`` (an index into ``text``), else None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: tuple[str, ...], start: int) -> int:
    """How many characters at the end of ``text`` (not before ``start``) could be the beginning of a stop sequence:
    a stream must not send them until the next tokens tell."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text) - start), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


# A nucleus (top_p) is looked for first among the tokens at least NUCLEUS_RATIO as likely as the likeliest (a compare
# over the vocabulary; sorted alone: 0.47 ms a row over Gemma's 262,144 logits on 2 Zen 4 cores), then among the top
# 1,024 (``torch.topk``: ~1 ms a row, where sorting them all took 16-21 ms), 8,192 (2.5 ms), then all of them.
# Gemma-3-270M answering with 20 memories, 96 draws a setting: nucleus sizes median 1 / p90 9 at temperature 0.7,
# top_p 0.9; median 13 / p90 422 / max 1,375 at 1.0 and 0.95; the likely tokens held the nucleus in all but 3 of the
# 384 draws of four settings.
NUCLEUS_RATIO = 1e-4
NUCLEUS_CANDIDATES = (1024, 8192)


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
        probs, ids = nucleus(probs, sampling.top_p)
        return int(ids[draw(probs, generator)])
    return draw(probs, generator)


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_p nucleus of ``probs`` [vocab]: the likeliest tokens, most likely first, up to the first whose
    predecessors' mass reaches ``top_p`` (the likeliest always: a top_p below float32's range compares as 0), as
    (their probabilities, their ids). Candidates that hold ``top_p`` of the mass and are each at least as likely as
    any token outside them come first in a sort of the whole vocabulary, and once a candidate is left out every less
    likely token is too: so the nucleus found among them is the one that sort gives (tied tokens at its edge may
    come in another order)."""
    likely = torch.nonzero(probs >= probs.max() * NUCLEUS_RATIO).squeeze(1)  # none where a probability is NaN
    top, order = torch.sort(probs[likely], descending=True)
    mass = torch.cumsum(top, 0)
    if likely.numel() and float(mass[-1]) >= top_p:  # every other token is less likely and comes after them
        keep = _kept(top, mass, top_p)
        return top[keep], likely[order[keep]]
    for k in (*(k for k in NUCLEUS_CANDIDATES if k < probs.numel()), probs.numel()):
        top, ids = torch.topk(probs, k)  # sorted, most likely first
        keep = _kept(top, torch.cumsum(top, 0), top_p)
        if not bool(keep[-1]):
            break
    return top[keep], ids[keep]


def _kept(top: torch.Tensor, mass: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which of the sorted probabilities ``top`` (cumulative ``mass``) the nucleus keeps: those whose predecessors'
    mass is below ``top_p``, and the likeliest always (a top_p below float32's range compares as 0)."""
    keep = mass - top < top_p
    keep[0] = True
    return keep


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index drawn with probability ``probs[i] / probs.sum()``: one uniform number against the cumulative sum
    (float64, so 262,144 float32 terms lose nothing that matters), never an index of zero probability. An exponential
    race (argmax p / E, E ~ Exp(1)) draws the same distribution but needs a random number per token: 4.3 ms per draw
    over Gemma's vocabulary here, against ~0.3. Probabilities that are not finite still give an index in range, with
    no device-side assert to trip on CUDA (that would fail every later kernel of the process): a request's numbers
    stay that request's problem."""
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device) * cdf[-1]
    last = torch.searchsorted(cdf, cdf[-1:])  # the last index of non-zero probability
    return int(torch.minimum(torch.searchsorted(cdf, u, right=True), last).clamp_(0, probs.numel() - 1))
