"""On a CUDA machine the engine injects through the fused Triton kernel, and kv still equals text.

Skipped without CUDA (these machines); scripts/gpu-check.sh runs it on the GPU. The CPU half of the selection
(torch reference on CPU tensors) is tested in test_inject.py.
"""

import pytest
import torch

import tiny_models as tm
from inferscale.engine import Engine, MemoryItem
from inferscale.models.loader import from_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ITEMS = [
    MemoryItem("m0", "caroline went to paris in may 2023 with her sister"),
    MemoryItem("m1", "melanie painted the beach and her dog", timestamp="june 2022"),
    MemoryItem("m2", "they went camping with the kids and the cat"),
]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def cuda_engine(request):
    pytest.importorskip("triton")
    model = tm.model(request.param, sliding_window=8).to("cuda")
    return Engine(from_model(model, tm.tokenizer(), name=f"tiny-{request.param}-cuda"))


def test_engine_on_cuda_takes_the_triton_path(cuda_engine, monkeypatch):
    import inferscale.kernels.inject_triton as kt

    calls = []
    real = kt.inject_triton
    monkeypatch.setattr(kt, "inject_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    blocks = cuda_engine.encode(ITEMS)
    cuda_engine.prefill(cuda_engine.question_ids("who painted?"), blocks, "kv")
    assert calls, "CUDA tensors went through the torch reference"


def test_kv_equals_text_on_cuda_for_blocks_at_their_encoded_positions(cuda_engine):
    blocks = cuda_engine.encode(ITEMS[:1])
    q = cuda_engine.question_ids("where did caroline go?")
    text, kv = cuda_engine.prefill(q, blocks, "text"), cuda_engine.prefill(q, blocks, "kv")
    assert (text.logits - kv.logits).abs().max() < 1e-3


def test_moved_blocks_on_cuda_match_the_cpu_engine(cuda_engine):
    """Several blocks, each rotated to a new position: the Triton path gives the CPU reference's logits."""
    family = cuda_engine.loaded.name.split("-")[1]
    cpu = tm.engine(family, sliding_window=8)  # same seed, same weights, on CPU
    q = cpu.question_ids("what did melanie paint?")
    want = cpu.prefill(q, cpu.encode(ITEMS), "kv").logits
    got = cuda_engine.prefill(q, cuda_engine.encode(ITEMS), "kv").logits.cpu()
    assert (got - want).abs().max() < 1e-3
