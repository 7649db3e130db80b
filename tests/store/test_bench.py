"""The store benchmark runs end to end (tiny sizes) and writes the documented JSON rows."""

import argparse
import json

from inferscale.bench import store as bench


def test_bench_store_smoke(tmp_path, capsys):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "rows.json"
    args = p.parse_args(["--json", str(out), "--blocks", "4", "--min-tokens", "2", "--max-tokens", "3",
                         "--repeats", "2", "--dir", str(tmp_path / "work")])
    assert bench.run(args) == 0
    rows = json.loads(out.read_text())
    assert [r["source"] for r in rows] == ["disk", "disk+verify", "disk+unseal", "dram", "dram-copy", "peer",
                                          "peer-locate", "peer+verify+persist"]
    for r in rows:
        assert {"source", "blocks", "bytes", "ms", "gbps", "baseline", "baseline_gbps"} <= set(r)
        # bf16 blocks by default: at least 4 blocks x 2 tokens x 18 layers x (K, V) x 256 x 2 bytes
        assert r["blocks"] == 4 and r["bytes"] > 4 * 2 * 18 * 2 * 256 * 2 and r["ms"] > 0
        assert r["kv_dtype"] == "bf16" and r["bytes_per_token"] == 18 * 2 * 256 * 2
    assert "peer" in capsys.readouterr().out


def test_bench_store_rows_per_kv_dtype_carry_compact_sizes(tmp_path, capsys):
    """Each format is stored and moved compact: rows carry kv_dtype and bytes_per_token (scales included), int8
    at most 0.55x bf16, and the bytes every source moves shrink with it."""
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "rows.json"
    args = p.parse_args(["--json", str(out), "--blocks", "3", "--min-tokens", "2", "--max-tokens", "3",
                         "--repeats", "1", "--dir", str(tmp_path / "work"), "--kv-dtype", "bf16,int8"])
    assert bench.run(args) == 0
    rows = json.loads(out.read_text())
    by = {(r["kv_dtype"], r["source"]): r for r in rows}
    assert {k for k, _ in by} == {"bf16", "int8"}
    bf16, int8 = by[("bf16", "disk")], by[("int8", "disk")]
    assert bf16["bytes_per_token"] == 18 * 2 * 256 * 2  # Gemma-3-270M in bf16: 18 KiB a token
    assert int8["bytes_per_token"] == 18 * 2 * (256 + 4)  # int8 codes + one float32 scale per head and token
    assert int8["bytes_per_token"] <= 0.55 * bf16["bytes_per_token"]
    for source in ("disk", "dram", "peer"):
        assert by[("int8", source)]["bytes"] < 0.6 * by[("bf16", source)]["bytes"]
    assert "0.508x bf16" in capsys.readouterr().out
