"""``inferscale plan``: the 8B/1M-user scenario's storage, compact formats at their own bytes-per-token ratio,
and the simulation (the store's block cache and fetch planner) switching to recompute on a throttled disk."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from inferscale.capacity.fleet import PlanInputs, plan_fleet
from inferscale.capacity.shapes import KNOWN, model_shape
from inferscale.capacity.simulate import NodeShape
from inferscale.capacity.workload import Population
from inferscale.cli import main
from inferscale.errors import ConfigError
from inferscale.kvquant import stored_bytes_per_token

H200 = NodeShape(hbm_bytes=40 * 10**9, dram_bytes=10**12, disk_bytes=15 * 10**12, dram_gbs=50.0, disk_gbs=12.0,
                 dram_fixed_s=10e-6, disk_fixed_s=80e-6, prefill_tokens_s=30_000.0)
SCENARIO = Population(users=1_000_000, mu=math.log(200), sigma=1.164, tokens_per_memory=30, daily_active=0.10)


def small(kv_dtype: str = "bf16", node: NodeShape = H200) -> PlanInputs:
    """The issue's scenario, with a node simulated on a small sample (fast; storage does not depend on it)."""
    return PlanInputs(model=KNOWN["llama-3-8b"], kv_dtype=kv_dtype, population=SCENARIO, node=node,
                      sample_users=1_500, sim_requests=3_000)


def test_8b_scenario_storage_is_1_55_pb_in_bf16():
    plan = plan_fleet(small())
    assert plan["bytes_per_token"] == 131_072
    assert plan["mean_memories"] == pytest.approx(393, abs=1)
    assert plan["storage_bytes"]["bf16"] == pytest.approx(1.55e15, rel=0.05)
    assert plan["nodes_by_storage"] == math.ceil(plan["storage_bytes"]["bf16"] / H200.disk_bytes)


def test_compact_formats_store_at_exactly_their_bytes_per_token_ratio():
    plan = plan_fleet(small("int4"))
    shape = KNOWN["llama-3-8b"]
    for d, s in plan["storage_bytes"].items():
        bpt = stored_bytes_per_token(d, layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim)
        assert plan["bytes_per_token_by_dtype"][d] == bpt
        assert s / plan["storage_bytes"]["bf16"] == pytest.approx(bpt / 131_072, rel=1e-12)
    assert plan["bytes_per_token_ratio"]["int4"] == pytest.approx(0.3125)  # int4 groups of 32 + float32 scales
    assert plan["storage_bytes"]["int4"] == pytest.approx(0.48e15, rel=0.02)


def test_per_block_moves_far_fewer_bytes_than_whole_user():
    modes = plan_fleet(small())["modes"]
    block, user = modes["per-block"], modes["whole-user"]
    assert block["bytes_per_request"] * 10 < user["bytes_per_request"]
    assert block["fetch_p99_s"] < user["fetch_p99_s"]


def test_throttled_disk_makes_the_simulated_node_recompute():
    fast = plan_fleet(small())["modes"]["per-block"]
    throttled = plan_fleet(small(node=dataclasses.replace(H200, disk_gbs=0.05)))["modes"]["per-block"]
    assert fast["share_disk"] > 0.05 and fast["recompute_share"] < 0.05
    # Throttled: the disk serves only the planner's probes; what it served when fast is recomputed instead.
    assert throttled["share_disk"] < 0.01 and throttled["recompute_share"] > fast["share_disk"] * 0.8


def test_model_from_an_hf_config(tmp_path):
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = model_shape(str(tmp_path))
    assert shape.bytes_per_token("bf16") == 131_072
    assert shape.params == pytest.approx(8.03e9, rel=0.01)
    with pytest.raises(ConfigError, match="nowhere"):
        model_shape("nowhere")


def test_trace_file_drives_the_simulation(tmp_path):
    trace = tmp_path / "trace.csv"
    rows = ["user,k,time,memories"] + [f"u{i % 7},4,{i * 0.5},{20 + i % 7}" for i in range(300)]
    trace.write_text("\n".join(rows) + "\n")
    plan = plan_fleet(dataclasses.replace(small(), trace=trace))
    assert plan["users"] == 7 and plan["requests_per_s"] == pytest.approx(300 / 149.5)
    assert plan["mean_memories"] == pytest.approx(sum(20 + i for i in range(7)) / 7)
    bad = tmp_path / "bad.csv"
    bad.write_text("who,when\nx,1\n")
    with pytest.raises(ConfigError, match="bad.csv"):
        plan_fleet(dataclasses.replace(small(), trace=bad))


def test_cli_prints_the_table_and_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--sample-users", "800", "--sim-requests", "1500", "--json", str(out_json),
                 "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "| per-block |" in printed and "| whole-user |" in printed and "1.55 PB" in printed
    assert json.loads(out_json.read_text())["nodes"] >= 104
    assert out_png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8", "int4"])
def test_bytes_per_token_is_what_a_stored_block_takes(kv_dtype):
    """The planner's bytes per token equal a real compact block's stored bytes (values + scales) per token."""
    import torch

    from inferscale.kvquant import quantize

    layers, heads, tokens, dim = 3, 2, 7, 128
    kv, scale = quantize(torch.randn(layers, 2, heads, tokens, dim, dtype=torch.bfloat16), kv_dtype)
    stored = kv.nbytes + (0 if scale is None else scale.nbytes)
    assert stored_bytes_per_token(kv_dtype, layers=layers, kv_heads=heads, head_dim=dim) * tokens == stored
