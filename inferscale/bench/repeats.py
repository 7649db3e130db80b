"""What the timing benches report over their ``--repeats``: each number's median with its min and max."""

from __future__ import annotations

import statistics


def spread(summaries: list[dict]) -> dict:
    """Median, min and max of each number over the repeats' summaries (a number a repeat left None: skipped)."""
    out = {}
    for key in summaries[0]:
        values = [s[key] for s in summaries if s.get(key) is not None]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def print_spread(summary: dict, width: int) -> None:
    """``spread``'s numbers, a line each, the names padded to ``width``."""
    print("summary (median [min, max] over repeats):")
    for key, v in summary.items():
        print(f"  {key:<{width}} {v['median']:10.2f}  [{v['min']:.2f}, {v['max']:.2f}]")
