"""``inferscale bench isolation``: a smoke run (tiny random-weight model, a few probes) and the KS fallback."""

from __future__ import annotations

import argparse
import builtins
import json

from inferscale.bench import isolation


def test_ks_fallback_without_scipy(monkeypatch):
    real_import = builtins.__import__

    def no_scipy(name, *a, **k):
        if name.startswith("scipy"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_scipy)
    same = [float(i) for i in range(40)]
    d, p = isolation.ks_2samp(same, same)
    assert d == 0.0 and p == 1.0
    d, p = isolation.ks_2samp(same, [x + 100 for x in same])
    assert d == 1.0 and p < 1e-6
    d, p = isolation.ks_2samp(same, [x + 0.5 for x in same])  # a shift smaller than the spacing: same shape
    assert p > 0.9


def test_bench_isolation_smoke(tmp_path, capsys):
    out = tmp_path / "iso.json"
    args = argparse.Namespace(model=None, random_weights="llama-tiny", probes=3, memories=3, k=2,
                              dram_budget_bytes=64 << 20, device="cpu", seed=0, json=str(out))
    assert isolation.run(args) == 0
    res = json.loads(out.read_text())
    assert set(res["groups"]) == {"hit", "random", "active", "idle"}
    assert all(len(v) == 3 and min(v) > 0 for v in res["samples_ms"].values())
    for r in res["ks"].values():
        assert 0.0 <= r["p"] <= 1.0 and r["indistinguishable"] == (r["p"] > 0.05)
    assert "KS hit_vs_random" in capsys.readouterr().out
