"""``inferscale serve --engine``: without TensorRT-LLM the trtllm engine fails at start, in one line, before any
model loads or file is written; with the stand-in it serves the modes TensorRT-LLM can (the rest of the API runs on
both engines through ``engine_live`` in test_api.py, test_tenancy.py and test_openai_compat.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest

from conftest import MODEL


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_engine_trtllm_without_tensorrt_llm_fails_at_start_in_one_line(tmp_path, how):
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSCALE_")}
    argv = [sys.executable, "-m", "inferscale.cli", "serve", "--data-dir", str(data), "--port", "18302"]
    if how == "flag":
        argv += ["--engine", "trtllm"]
    else:
        env["INFERSCALE_ENGINE"] = "trtllm"
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("inferscale: error: --engine trtllm needs the 'tensorrt_llm'")
    assert "Loading" not in proc.stdout and not data.exists()  # nothing loaded, no tenants file written


def test_an_unknown_engine_is_a_config_error(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INFERSCALE_")}, "INFERSCALE_ENGINE": "vllm"}
    proc = subprocess.run([sys.executable, "-m", "inferscale.cli", "serve", "--data-dir", str(tmp_path / "d")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "INFERSCALE_ENGINE" in proc.stderr


def test_the_trtllm_engine_lists_and_serves_its_modes(live_trtllm):
    card = live_trtllm.client().models.list().data[0]
    assert card.model_extra["inferscale"]["modes"] == ["kv", "text", "none"]
    with pytest.raises(openai.BadRequestError) as e:
        live_trtllm.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            extra_body={"inferscale": {"mode": "kv-recompute"}})
    assert e.value.body["code"] == "mode_unavailable" and e.value.param == "inferscale.mode"


def test_the_trtllm_engine_sizes_its_kv_cache_at_the_servers_kv_budget(live_trtllm, tiny_engine):
    """INFERSCALE_KV_CACHE_BYTES reaches TensorRT-LLM as KvCacheConfig.max_tokens (it takes the lesser of that and
    free_gpu_memory_fraction, and admits by free blocks), in the model's tokens."""
    kv = live_trtllm.app.state.worker.llm.args.kv_cache_config
    assert kv.max_tokens == live_trtllm.app.state.settings.kv_cache_bytes // tiny_engine.kv_token_bytes > 0
