"""The engine's torch thread rule (issue 22): all usable cores but one, at least one; an explicit count wins."""

from __future__ import annotations

import pytest
import torch

from inferscale.engine.threads import configure_threads, default_threads, usable_cores
from inferscale.errors import ConfigError


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_automatic_leaves_one_core_to_the_rest_of_the_process(restore_threads):
    assert configure_threads(0) == torch.get_num_threads() == max(1, usable_cores() - 1) == default_threads()


def test_an_explicit_count_is_set(restore_threads):
    assert configure_threads(1) == torch.get_num_threads() == 1


def test_a_negative_count_is_a_config_error():
    with pytest.raises(ConfigError, match="threads=-1"):
        configure_threads(-1)
