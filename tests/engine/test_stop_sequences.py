"""Stop sequences in the serving loop: matched on decoded text across tokens, never emitted (not even their start
while it is undecided), the earliest of several wins, a held-back prefix that turns out not to stop is sent."""

from __future__ import annotations

import pytest

import tiny_models as tm
from inferscale.engine import Sampling
from inferscale.engine.loop import DoneEvent, GenRequest, ServingLoop, TokenEvent
from inferscale.engine.sampling import find_stop, held_back
from inferscale.errors import InvalidInputError

SAID = "Hello the dog went to paris"  # tiny tokenizer: single characters and a few words ("▁the", "▁dog")


@pytest.fixture(scope="module")
def engine():
    return tm.engine("gemma3")


def run(engine, **sampling) -> tuple[list[TokenEvent], DoneEvent]:
    events: list = []
    loop = ServingLoop(engine)
    loop.add(GenRequest(ids=engine.question_ids("hi"), blocks=[], mode="none", emit=events.append,
                        sampling=Sampling(**{"max_new_tokens": 12, "ignore_eos": True, **sampling})))
    with tm.forced_output(engine, SAID):
        loop.run_until_done()
    return [e for e in events if isinstance(e, TokenEvent)], events[-1]


def test_a_stop_across_tokens_is_cut_and_never_emitted(engine):
    tokens, done = run(engine, stop=("e do",))
    text = "".join(t.text for t in tokens)
    assert text == "Hello th" and done.finish_reason == "stop"
    assert tokens[-1].text == "" or "e" not in tokens[-1].text  # " the" was held back until " dog" decided it
    assert done.completion_tokens == 7  # H e l l o ▁the ▁dog: the token completing the stop counts


def test_the_earliest_of_several_stops_wins(engine):
    tokens, done = run(engine, stop=("paris", "dog", "llo"))
    assert "".join(t.text for t in tokens) == "He" and done.finish_reason == "stop"


def test_a_held_back_prefix_that_does_not_stop_is_sent(engine):
    tokens, done = run(engine, stop=("the cat",), max_new_tokens=9)
    assert "".join(t.text for t in tokens) == "Hello the dog went to" and done.finish_reason == "length"


def test_no_stop_given_means_the_profile_default_unless_ignore_eos(engine):
    assert engine.template.default_stop == ("\n",)
    assert Sampling().stops(engine.template.default_stop) == ("\n",)
    assert Sampling(ignore_eos=True).stops(("\n",)) == ()
    assert Sampling(stop=("x",), ignore_eos=True).stops(("\n",)) == ("x",)
    assert Sampling(stop=()).stops(("\n",)) == ()


def test_min_tokens_defers_stops(engine):
    tokens, done = run(engine, stop=("l",), min_tokens=4)
    # "Hel" said before min_tokens: its "l"s do not count; the first "l" after is the 4th token's.
    assert "".join(t.text for t in tokens) == "Hel" and done.completion_tokens == 4


def test_matching_helpers():
    assert find_stop("abcabc", ("ca", "bc"), 0) == 1
    assert find_stop("abcabc", ("ca",), 3) is None
    assert held_back("hello wo", ("world",), 0) == 2
    assert held_back("hello wo", ("world", "o wor"), 0) == 4  # the longest undecided suffix: "o wo"
    assert held_back("hello", ("xyz",), 0) == 0
    assert held_back("ab", ("abc",), 2) == 0  # nothing after the floor


@pytest.mark.parametrize("stop", [("",), ("a", "b", "c", "d", "e"), (1,)])
def test_bad_stops_are_invalid_input_errors(stop):
    with pytest.raises(InvalidInputError):
        Sampling(stop=stop)
