"""Which rows the LM head's screen answers (``engine/tokenchoice.py``, issue 22): a greedy row with stop tokens
banned (``min_tokens``, aiperf's way to force an answer's length) keeps the screen's argmax unless it is banned;
then the logits are computed and the loop takes the first maximum of the tokens it may choose."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferscale.engine import tokenchoice
from inferscale.engine.sampling import Sampling
from inferscale.models.greedyhead import Head

STOP = 3


@dataclass
class Row:
    sampling: Sampling
    output: list[int]
    keep_first_logits: bool = False
    first_token: int | None = None


class Screen:
    """Stands in for ``GreedyHead``: the full argmax of the logits it is given, counting its calls."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.calls = logits, 0

    def argmax(self, hidden: torch.Tensor) -> list[int]:
        self.calls += 1
        return self.logits.max(dim=-1).indices.tolist()


def _head(logits: torch.Tensor) -> tuple[Head, list[int]]:
    projected: list[int] = []
    return Head(hidden=torch.zeros(logits.shape[0], 4), project=lambda h: projected.append(1) or logits,
                greedy=Screen(logits)), projected


def test_min_tokens_rows_keep_the_screen_when_the_argmax_is_not_banned():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [0.0, 1.0, 7.0, 2.0]])
    head, projected = _head(logits)
    rows = [Row(Sampling(min_tokens=8), output=[]), Row(Sampling(), output=[])]
    assert tokenchoice.choices(head, rows, {STOP}) == [(None, 1), (None, 2)]
    assert head.greedy.calls == 1 and not projected, "the full head was not read"


def test_a_banned_argmax_computes_the_logits_and_the_row_takes_the_best_it_may_choose():
    logits = torch.tensor([[0.0, 5.0, 1.0, 9.0], [0.0, 1.0, 7.0, 2.0]])
    head, projected = _head(logits)
    rows = [Row(Sampling(min_tokens=8), output=[]), Row(Sampling(), output=[])]
    (lg0, t0), (lg1, t1) = tokenchoice.choices(head, rows, {STOP})
    assert projected and torch.equal(lg0, logits[0]) and (t0, t1) == (STOP, 2)
    assert not tokenchoice.decides(rows[0], t0, {STOP}) and tokenchoice.decides(rows[1], t1, {STOP})
    rows[0].output = list(range(8))  # min_tokens reached: the stop token may be chosen
    assert tokenchoice.decides(rows[0], t0, {STOP})


def test_sampled_rows_and_kept_first_logits_read_the_full_head():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    for row in (Row(Sampling(temperature=0.7), output=[]), Row(Sampling(), output=[], keep_first_logits=True)):
        head, projected = _head(logits)
        (lg, token), = tokenchoice.choices(head, [row], {STOP})
        assert projected and head.greedy.calls == 0 and torch.equal(lg, logits[0]) and token == 1
