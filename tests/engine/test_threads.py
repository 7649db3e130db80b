"""The engine's torch thread rule (issue 22): every usable core; -1 tunes between 1 and all by the decode passes'
own times; an explicit count wins and is never tuned."""

from __future__ import annotations

import pytest
import torch

from inferscale.engine.threads import configure_threads, default_threads, tuned_choices, usable_cores
from inferscale.engine.threadtuner import MAX_EVERY, PROBE_EVERY, RECENT, ThreadTuner
from inferscale.errors import ConfigError


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    configure_threads(before)


def test_the_default_is_every_core_untuned(restore_threads):
    assert configure_threads(0) == torch.get_num_threads() == usable_cores() == default_threads()
    assert tuned_choices() == ()


def test_minus_one_starts_with_every_core_and_tunes_between_one_and_all(restore_threads):
    assert configure_threads(-1) == torch.get_num_threads() == usable_cores()
    assert tuned_choices() == ((1, usable_cores()) if usable_cores() > 1 else ())


def test_an_explicit_count_is_set_and_not_tuned(restore_threads):
    assert configure_threads(1) == torch.get_num_threads() == 1
    assert tuned_choices() == ()
    assert not ThreadTuner(tuned_choices(), torch.set_num_threads).active


def test_a_negative_count_is_a_config_error():
    with pytest.raises(ConfigError, match="threads=-2"):
        configure_threads(-2)


def run(tuner: ThreadTuner, seconds: dict[int, float], passes: int, batch: int = 4) -> list[int]:
    """Drive ``tuner`` for ``passes`` decode passes whose time depends only on the thread count set."""
    state = {"n": tuner.current}
    tuner._set = lambda n: state.__setitem__("n", n)
    used = []
    for _ in range(passes):
        tuner.before_decode(batch)
        used.append(state["n"])
        tuner.after_decode(batch, seconds[state["n"]])
    return used


def test_the_tuner_switches_to_the_faster_count_and_stays():
    tuner = ThreadTuner((1, 2), lambda n: None)
    used = run(tuner, {1: 0.1, 2: 0.5}, 200)  # two threads lose (a loaded machine)
    assert tuner.current == 1
    assert used[:PROBE_EVERY] == [2] * PROBE_EVERY and used[PROBE_EVERY] == 1
    assert used[-100:].count(2) <= 1  # probing the loser again is rare


def test_the_tuner_keeps_the_current_count_when_the_other_loses_and_probes_less_often():
    tuner = ThreadTuner((1, 2), lambda n: None)
    used = run(tuner, {1: 0.2, 2: 0.1}, 3000)  # two threads win (a quiet machine)
    assert tuner.current == 2 and tuner.every == MAX_EVERY
    assert used.count(1) <= 12  # a handful of probes in 3000 passes (after 16, 32, 64 ... then every 512)


def test_a_probe_waits_for_passes_at_the_same_batch_size():
    tuner = ThreadTuner((1, 2), lambda n: None)
    state = {"n": 2}
    tuner._set = lambda n: state.__setitem__("n", n)
    for i in range(PROBE_EVERY + RECENT):
        tuner.before_decode(i)  # the batch changes every pass: no fair comparison, no probe
        assert state["n"] == 2
        tuner.after_decode(i, 0.1)
