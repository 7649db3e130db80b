"""The chart's engine value (issue 21): ``engine: trtllm`` renders a TensorRT-LLM serving fleet, ``pytorch`` (the
default) the project's engine; the encode Jobs keep the serving image either way (memories are encoded by the
project's model)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chart import (CHART, _validate_all, container, docs, effective_env, helm, render,  # noqa: E402
                        template_args, workload)

APP = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


def _server(*values: str, sets: tuple[str, ...] = ()):
    m = docs(*values, sets=sets)
    s = workload(m, "server")
    return m, container(s), effective_env(m, s)


def test_one_value_renders_a_tensorrt_llm_serving_fleet():
    m, c, env = _server("values.yaml", sets=("engine=trtllm",))
    assert c["image"] == f"inferscale/inferscale-trtllm:{APP}"  # the Dockerfile's server-trtllm target
    assert c["args"][:2] == ["--engine", "trtllm"]
    assert env["INFERSCALE_ENGINE"] == "trtllm"
    assert env["INFERSCALE_TRTLLM_MODEL"] == "gemma-3-270m" and env["INFERSCALE_TRTLLM_TOKENS_PER_BLOCK"] == "32"
    op = effective_env(m, workload(m, "operator"))
    assert op["INFERSCALE_ENCODER_IMAGE"] == f"inferscale/inferscale:{APP}"  # encoding stays on the project's model
    _validate_all(render("values.yaml", sets=("engine=trtllm",)))


def test_the_default_fleet_runs_the_pytorch_engine():
    _, c, env = _server("values.yaml")
    assert c["image"] == f"inferscale/inferscale:{APP}"
    assert c["args"][:2] == ["--engine", "pytorch"] and env["INFERSCALE_ENGINE"] == "pytorch"
    assert "INFERSCALE_TRTLLM_MODEL" not in env


def test_trtllm_image_model_and_page_size_are_settable():
    _, c, env = _server("values-gpu.yaml", sets=("engine=trtllm", "trtllm.image.repository=reg.example/trt",
                                                 "trtllm.image.tag=v9", "trtllm.model=/models/llama",
                                                 "trtllm.tokensPerBlock=64", "server.extraArgs={--default-mode,text}"))
    assert c["image"] == "reg.example/trt:v9"
    assert c["args"] == ["--engine", "trtllm", "--default-mode", "text"]
    assert env["INFERSCALE_TRTLLM_MODEL"] == "/models/llama" and env["INFERSCALE_TRTLLM_TOKENS_PER_BLOCK"] == "64"


def test_trtllm_on_a_cpu_fleet_or_an_unknown_engine_is_refused():
    proc = helm(*template_args("values-cpu.yaml", sets=("engine=trtllm",)), check=False)
    assert proc.returncode != 0 and "needs server.device=cuda" in proc.stderr
    proc = helm(*template_args("values.yaml", sets=("engine=vllm",)), check=False)
    assert proc.returncode != 0 and "engine" in proc.stderr
