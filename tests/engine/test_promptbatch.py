"""Grouping a step's prompt chunks into padded passes (inferscale/engine/promptbatch.py)."""

from __future__ import annotations

from inferscale.engine.promptbatch import MAX_PADDING, next_piece, padded_groups


def _padding(lengths: list[int], group: list[int]) -> float:
    padded = len(group) * max(lengths[i] for i in group)
    return (padded - sum(lengths[i] for i in group)) / padded


def test_chunks_of_like_length_share_a_pass():
    assert padded_groups([20, 22, 19, 21]) == [[0, 1, 2, 3]]


def test_a_long_chunk_does_not_pad_a_short_question():
    lengths = [128, 20, 128, 18, 22]
    groups = padded_groups(lengths)
    assert sorted(map(sorted, groups)) == [[0, 2], [1, 3, 4]]
    assert all(_padding(lengths, g) <= MAX_PADDING for g in groups)


def test_the_first_turns_chunk_is_in_the_first_pass():
    # A newcomer's short question has the first turn; the flood's long chunks come after it.
    assert padded_groups([15, 128, 128])[0] == [0]
    assert padded_groups([128, 15, 128])[0] == [0, 2]


def test_every_chunk_is_in_exactly_one_group_within_the_padding_bound():
    lengths = [3, 128, 64, 60, 7, 128, 1, 100, 90, 5, 5, 6]
    groups = padded_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g == sorted(g) for g in groups)
    assert all(_padding(lengths, g) <= MAX_PADDING for g in groups)
    assert padded_groups([]) == []
    assert padded_groups([9, 1], max_padding=1.0) == [[0, 1]]


def test_a_pass_holds_at_most_max_tokens_padded():
    # 16 questions of 31 tokens, passes of 109 tokens (what fits in step_time_s): three rows a pass
    groups = padded_groups([31] * 16, max_tokens=109)
    assert [len(g) for g in groups] == [3, 3, 3, 3, 3, 1]
    assert sorted(i for g in groups for i in g) == list(range(16))
    assert padded_groups([128, 20], max_tokens=64) == [[0], [1]]  # a longer chunk is a pass of its own


def test_a_chunk_longer_than_a_pass_is_cut_without_leaving_a_sliver():
    assert next_piece(90, 32, 8) == 32 and next_piece(58, 32, 8) == 32 and next_piece(26, 32, 8) == 26
    assert next_piece(34, 33, 8) == 34  # 33 + 1 would be a pass for one token
    assert next_piece(90, None, 8) == 90


def test_no_piece_passes_the_fast_kernels_rows():
    """A chunk a sliver longer than the kernels' rows (``most``) is not one pass past them (there a pass runs on
    SDPA and oneDNN: a 66-token pass took 59 ms against a 61-token one's 33 when the kernels stopped at 64) but two
    halves; within them the sliver still rides along."""
    assert next_piece(131, None, 32, most=128) == 66 and next_piece(65, None, 32, most=128) == 65
    assert next_piece(131, 100, 32, most=128) == 66 and next_piece(120, 100, 32, most=128) == 120
    assert next_piece(200, None, 32, most=128) == 128 and next_piece(140, 100, 32, most=128) == 100
    assert next_piece(34, 33, 8, most=64) == 34 and next_piece(128, None, 32, most=128) == 128
