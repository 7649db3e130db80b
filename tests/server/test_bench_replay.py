"""``inferscale bench replay`` end to end at a tiny size: the real server over loopback on a tiny engine, the
store's counters against the capacity simulator. Checks the JSON it writes, never a timing."""

from inferscale.bench.replay import ReplayConfig, replay


def test_replay_reports_both_hit_rates_and_the_bytes(tmp_path, tiny_engine, embedder):
    cfg = ReplayConfig(users=3, memories=12, k=2, requests=24, dram_fraction=0.3, port=24517)
    r = replay(cfg, tiny_engine, embedder, tmp_path)
    for key in ("dram_hit_rate_measured", "dram_hit_rate_predicted"):
        assert 0.0 <= r[key] <= 1.0, (key, r[key])
    assert r["config"]["measured_requests"] == 16
    assert r["bytes_per_request_per_block_measured"] > 0
    # whole users of ~12 memories against k=2 blocks: whole-user caching moves several times the bytes
    assert r["bytes_per_request_whole_user_simulated"] > 2 * r["bytes_per_request_per_block_predicted"]
    s = r["store"]
    assert s["dram_hits"] + s["disk_reads"] == 24 * 2 and s["dram_bytes"] <= s["dram_budget"]
