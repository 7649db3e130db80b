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
                                          "peer+verify+persist"]
    for r in rows:
        assert {"source", "blocks", "bytes", "ms", "gbps", "baseline", "baseline_gbps"} <= set(r)
        assert r["blocks"] == 4 and r["bytes"] > 4 * 2 * 18 * 2 * 256 * 4 and r["ms"] > 0
    assert "peer" in capsys.readouterr().out
