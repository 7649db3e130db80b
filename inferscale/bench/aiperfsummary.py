"""One line per aiperf run that ``scripts/aiperf.sh`` made, read from aiperf's own JSON export
(``<data>/aiperf-<mode>-c<concurrency>/profile_export_aiperf.json``): TTFT p50, inter-token p50 and output tokens/s.
A run at concurrency N > 1 also shows its ratios over concurrency 1 of the same mode: output tokens/s, and decode
per stream, N x the inter-token latency at 1 over the one at N (what "N streams decode N times one" means, with
the prompt passes of the requests that replace finished ones counted in, as aiperf counts them).

``python -m inferscale.bench.aiperfsummary DATA MODE [MODE ...]``
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from inferscale.errors import InvalidInputError

EXPORT = "profile_export_aiperf.json"


@dataclass(frozen=True)
class AiperfRun:
    concurrency: int
    ttft_p50_ms: float
    itl_p50_ms: float
    output_tokens_per_s: float

    @classmethod
    def read(cls, directory: Path) -> AiperfRun:
        concurrency = directory.name.rpartition("-c")[2]  # aiperf-<mode>-c<concurrency>
        try:
            export = json.loads((directory / EXPORT).read_text())
            return cls(int(concurrency), float(export["time_to_first_token"]["p50"]),
                       float(export["inter_token_latency"]["p50"]), float(export["output_token_throughput"]["avg"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidInputError(f"{directory / EXPORT}: not an aiperf export with TTFT, inter-token latency and "
                                    f"output throughput ({type(e).__name__}: {e})") from None


def runs(data: Path, mode: str) -> list[AiperfRun]:
    """The runs of ``mode`` under ``data`` that left an export, by concurrency."""
    found = [AiperfRun.read(d) for d in data.glob(f"aiperf-{mode}-c*") if (d / EXPORT).exists()]
    return sorted(found, key=lambda r: r.concurrency)


def lines(data: Path, modes: list[str]) -> list[str]:
    out = []
    for mode in modes:
        found = runs(data, mode)
        one = next((r for r in found if r.concurrency == 1), None)
        for r in found:
            line = (f"summary {mode} concurrency {r.concurrency}: TTFT p50 {r.ttft_p50_ms:.1f} ms, inter-token p50 "
                    f"{r.itl_p50_ms:.1f} ms, output {r.output_tokens_per_s:.1f} tokens/s")
            if one is not None and r.concurrency > 1:
                line += (f"; over concurrency 1: output tokens/s {r.output_tokens_per_s / one.output_tokens_per_s:.2f}x,"
                         f" decode {r.concurrency * one.itl_p50_ms / r.itl_p50_ms:.2f}x ({r.concurrency} x its "
                         "inter-token latency / this one's)")
            out.append(line)
    return out


if __name__ == "__main__":
    print("\n".join(lines(Path(sys.argv[1]), sys.argv[2:])))
