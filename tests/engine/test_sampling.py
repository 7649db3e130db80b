"""The sampler (``engine/sampling.py``, issue 22): the top_p nucleus found among the top candidates is the one a
sort of the whole vocabulary gives, and draws follow the probabilities, never a token of zero probability, repeatably
for a seed. A sort of Gemma's 262,144 logits and a random number per token took 23 ms a token; this path ~1-2."""

from __future__ import annotations

import pytest
import torch

from inferscale.engine import sampling
from inferscale.engine.sampling import Sampling, draw, nucleus, sample


def _sorted_nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """The nucleus as the sampler once computed it: a sort of every probability."""
    sorted_p, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
    keep[0] = True
    return set(order[keep].tolist())


@pytest.mark.parametrize("scale", [0.01, 1.0, 3.0, 10.0])  # flat (most of 20,000 tokens) to peaked (one or two)
@pytest.mark.parametrize("top_p", [1e-9, 0.5, 0.9, 0.999])
def test_the_nucleus_is_the_one_a_full_sort_gives(scale, top_p):
    gen = torch.Generator().manual_seed(int(scale * 100) + int(top_p * 1000))
    probs = torch.softmax(torch.randn(20000, generator=gen) * scale, dim=-1)
    top, ids = nucleus(probs, top_p)
    assert set(ids.tolist()) == _sorted_nucleus(probs, top_p)
    assert torch.equal(top, probs[ids]) and bool((top[:-1] >= top[1:]).all())


@pytest.mark.parametrize("ratio", [1e-4, 0.5, 1.0])  # the likely tokens alone hold the nucleus, or not
def test_the_nucleus_is_the_same_whichever_candidates_hold_it(monkeypatch, ratio):
    monkeypatch.setattr(sampling, "NUCLEUS_RATIO", ratio)
    probs = torch.softmax(torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 2.0, dim=-1)
    for top_p in (0.05, 0.5, 0.9):
        assert set(nucleus(probs, top_p)[1].tolist()) == _sorted_nucleus(probs, top_p), (ratio, top_p)


def test_a_nucleus_past_every_candidate_count_is_still_found(monkeypatch):
    monkeypatch.setattr(sampling, "NUCLEUS_RATIO", 1.0)  # only the likeliest token: never enough here
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", (4, 16))
    probs = torch.softmax(torch.randn(300, generator=torch.Generator().manual_seed(1)) * 0.1, dim=-1)
    assert set(nucleus(probs, 0.9)[1].tolist()) == _sorted_nucleus(probs, 0.9) and len(_sorted_nucleus(probs, 0.9)) > 16


def test_draws_follow_the_probabilities_and_never_pick_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(3)
    draws = [draw(probs, gen) for _ in range(6000)]
    assert set(draws) <= {1, 3, 4}
    for i, p in ((1, 0.5), (3, 0.3), (4, 0.2)):
        assert abs(draws.count(i) / len(draws) - p) < 0.025, (i, draws.count(i))
    again = torch.Generator().manual_seed(3)
    assert [draw(probs, again) for _ in range(100)] == draws[:100]


def test_top_p_draws_only_from_the_nucleus_in_proportion():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    gen = torch.Generator().manual_seed(4)
    draws = [sample(logits, Sampling(temperature=1.0, top_p=0.8), gen) for _ in range(4000)]
    assert set(draws) == {1, 2}  # 0.5 + 0.3 reaches 0.8: the 0.15 and 0.05 tokens are out
    assert abs(draws.count(1) / len(draws) - 0.5 / 0.8) < 0.03


def test_a_distribution_with_every_token_out_but_one_is_that_token():
    probs = torch.zeros(1000)
    probs[777] = 1.0
    gen = torch.Generator().manual_seed(5)
    assert {draw(probs, gen) for _ in range(50)} == {777}
    assert {sample(torch.log(probs), Sampling(temperature=0.7, top_p=0.9), gen) for _ in range(20)} == {777}
