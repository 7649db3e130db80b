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
        keep[0] = True  # the likeliest token always (a top_p below float32's range compares as 0)
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    # The exponential race: argmax(p / E) with E ~ Exp(1) draws from p, as torch.multinomial does (vLLM samples so),
    # but probabilities that are not finite cannot trip a device-side assert, which on CUDA would fail every later
    # kernel of the process: a request's numbers stay that request's problem.
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / race))
