"""The frame depth check (inferscale/store/peer_protocol.py) strips JSON strings before counting brackets: an
escaped quote or a backslash at a string's end must not shift what counts as inside a string."""

import json

import pytest

from inferscale.store import peer_protocol as wire


@pytest.mark.parametrize("msg", [
    {"a": 'x"[[[[[[[[[[[[', "b": [1]},          # brackets after an escaped quote are still inside the string
    {"a": "\\", "b": "[[[[[[[[[[[[[[["},          # a string ending in a backslash
    {"a": "\\\"{{{{{{{{{{{{", "n": [[[[[[[1]]]]]]]},  # 7 deep: within the bound
])
def test_strings_never_count_as_nesting(msg):
    assert wire.parse_bounded(json.dumps(msg).encode()) == msg


def test_nesting_past_the_bound_is_refused_with_strings_around_it():
    deep = {"a": "\\\\", "b": "]]]]]]]]", "n": [[[[[[[[[1]]]]]]]]]}  # 10 deep
    with pytest.raises(wire.FrameError, match="deeper"):
        wire.parse_bounded(json.dumps(deep).encode())
