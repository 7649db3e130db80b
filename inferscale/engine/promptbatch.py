"""Which prompt chunks of a step share one forward pass (issue 22).

A forward pass reads every weight once whatever its rows, so a step's prompt chunks run together: one pass per
group, each chunk a row padded to the group's longest. Padding is work for nothing, so chunks are grouped by
length: a group takes the next shorter chunk only while its padded tokens stay within ``MAX_PADDING`` of the
tokens it computes in all, and a flood tenant's 128-token chunk does not pad a 20-token question to 128.
No torch: the loop pads and runs the groups.
"""

from __future__ import annotations

# The most of a group's padded size (rows x its longest chunk) that may be padding.
MAX_PADDING = 0.25


def padded_groups(lengths: list[int], max_padding: float = MAX_PADDING,
                  max_tokens: int | None = None) -> list[list[int]]:
    """The chunks of ``lengths`` (their tokens, in turn order) as groups of indices, each group's padding within
    ``max_padding`` of its padded size, and its padded size within ``max_tokens`` (a pass's time bound; a longer
    chunk is a group alone). Indices keep their order within a group, and groups run in the order of their first
    index: the chunk that had the first turn (a newcomer's) is in the first pass."""
    groups: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # longest first: a group's first is its width
        if groups:
            group = groups[-1]
            padded = (len(group) + 1) * lengths[group[0]]
            if padded - (tokens + lengths[i]) <= max_padding * padded and (max_tokens is None or padded <= max_tokens):
                group.append(i)
                tokens += lengths[i]
                continue
        groups.append([i])
        tokens = lengths[i]
    for group in groups:
        group.sort()
    return sorted(groups, key=lambda g: g[0])


def next_piece(n: int, pass_tokens: int | None, sliver: int, most: int | None = None) -> int:
    """The tokens of an n-token chunk the next pass computes: at most ``pass_tokens`` (a chunk longer than a pass
    runs over several), unless the rest would be fewer than ``sliver``, a pass of its own for a few tokens (a
    34-token question cut 33 + 1 paid a second ~30 ms pass): then all n, or where n passes ``most`` (the rows the
    model's fast kernels take, ``LoadedModel.pass_rows``) the first half: before any pass was timed (no
    ``pass_tokens``), a 131-token question (the scheduler's 128-token chunk and its 3-token tail) ran as one pass
    past them, on SDPA and oneDNN."""
    limit = min((t for t in (pass_tokens, most) if t is not None), default=None)
    if limit is None or n <= limit:
        return n
    if n - limit >= sliver:
        return limit
    return n if most is None or n <= most else (n + 1) // 2
