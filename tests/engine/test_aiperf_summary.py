"""scripts/aiperf.sh's summary (inferscale/bench/aiperfsummary.py) over aiperf exports laid out as the script leaves
them, and the script's refusal of a bad count before it starts anything."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from inferscale.bench.aiperfsummary import lines, runs
from inferscale.errors import InvalidInputError

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "aiperf.sh"


def _export(data: Path, mode: str, concurrency: int, ttft: float, itl: float, tokens_per_s: float) -> None:
    run = data / f"aiperf-{mode}-c{concurrency}"
    run.mkdir(parents=True)
    (run / "profile_export_aiperf.json").write_text(json.dumps({
        "time_to_first_token": {"unit": "ms", "p50": ttft, "avg": ttft + 1},
        "inter_token_latency": {"unit": "ms", "p50": itl, "avg": itl + 1},
        "output_token_throughput": {"unit": "tokens/sec", "avg": tokens_per_s}}))


def test_sixteen_streams_beside_one(tmp_path):
    _export(tmp_path, "kv", 16, 500.0, 40.0, 300.0)
    _export(tmp_path, "kv", 1, 60.0, 15.0, 60.0)
    _export(tmp_path, "kv-recompute", 1, 90.0, 15.0, 50.0)  # another mode's run: not kv's
    assert [r.concurrency for r in runs(tmp_path, "kv")] == [1, 16]
    one, sixteen = lines(tmp_path, ["kv"])
    assert one == "summary kv concurrency 1: TTFT p50 60.0 ms, inter-token p50 15.0 ms, output 60.0 tokens/s"
    # 300 / 60 tokens/s; 16 x 15 ms / 40 ms
    assert sixteen.startswith("summary kv concurrency 16: TTFT p50 500.0 ms") and \
        "output tokens/s 5.00x, decode 6.00x" in sixteen
    assert lines(tmp_path, ["kv-recompute"]) == [
        "summary kv-recompute concurrency 1: TTFT p50 90.0 ms, inter-token p50 15.0 ms, output 50.0 tokens/s"]


def test_without_concurrency_one_no_ratios(tmp_path):
    _export(tmp_path, "text", 16, 900.0, 45.0, 250.0)
    (line,) = lines(tmp_path, ["text"])
    assert "over concurrency 1" not in line


def test_a_broken_export_is_named(tmp_path):
    _export(tmp_path, "kv", 1, 60.0, 15.0, 60.0)
    (tmp_path / "aiperf-kv-c1" / "profile_export_aiperf.json").write_text('{"time_to_first_token": {}}')
    with pytest.raises(InvalidInputError, match="aiperf-kv-c1/profile_export_aiperf.json"):
        lines(tmp_path, ["kv"])


@pytest.mark.parametrize("env", [{"CONCURRENCY": "1 x"}, {"OUTPUT_TOKENS": "0"}, {"CONCURRENCY": "16; echo"}])
def test_the_script_refuses_a_bad_count_first(env):
    r = subprocess.run(["bash", str(SCRIPT), "8000", "20"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "AIPERF": "/nonexistent/aiperf", **env})
    assert r.returncode == 2 and "is not a positive integer" in r.stderr and "inferscale serve" not in r.stdout
