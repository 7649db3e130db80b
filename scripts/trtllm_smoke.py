"""TensorRT-LLM smoke test: needs a CUDA GPU and ``tensorrt_llm`` (run by scripts/gpu-check.sh).

A small random-weight Llama is written as an HF directory (with the tokenizer); InferScale encodes memories with
it; TensorRT-LLM then answers the prompt [prefix][memories][question] twice:
  baseline   no connector: TensorRT-LLM prefills every token itself
  connector  through the engine seam, ``TrtllmBackend`` (what ``inferscale serve --engine trtllm`` runs): it
             writes the plan and submits with tenant-a's cache_salt; the InferScale connector fills the
             page-aligned [prefix][memories] pages (blocks in their encoding order, so Δ = 0 and the injected KV is
             what a prefill computes)
and the greedy tokens are compared. The trace file proves the connector filled pages, and that the same token
ids from tenant-b, while tenant-a's plan was still held, got none. Writes JSON to argv[1].
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch


def main(out_json: str) -> int:
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig
    from transformers import AutoModelForCausalLM, LlamaConfig

    from inferscale.engine import Engine, MemoryItem
    from inferscale.models.loader import from_model, load_model

    work = Path(tempfile.mkdtemp(prefix="inferscale-trtllm-"))
    trace = work / "trace.txt"
    os.environ["INFERSCALE_TRTLLM_TRACE"] = str(trace)  # TensorRT-LLM's workers inherit it (the plan dir: the backend)

    tokenizer = load_model(None, device="cpu").tokenizer
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # sharper attention than the default init, so wrong KV shows in the tokens
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    model_dir = work / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)  # TensorRT-LLM detokenizes and applies stop strings for the backend
    engine = Engine(from_model(model.to("cuda"), tokenizer, name="smoke-llama", weights_digest="smoke"))

    items = [MemoryItem(f"m{i}", t) for i, t in enumerate([
        "caroline went to paris in may 2023 with her sister and they saw the eiffel tower",
        "melanie painted the beach and her dog during the summer holidays in cornwall",
        "they went camping with the kids and the cat near the lake in the mountains",
        "caroline loves the support group where she reads poems every thursday evening",
    ])]
    blocks = engine.encode(items)
    question = engine.question_ids("where did caroline go in may?")
    prompt = list(engine.prefix_ids) + [t for b in blocks for t in b.token_ids] + list(question)
    del engine, model
    torch.cuda.empty_cache()

    params = SamplingParams(max_tokens=8, temperature=0.0)
    kv_cfg = KvCacheConfig(enable_block_reuse=True, tokens_per_block=16, free_gpu_memory_fraction=0.2)
    result: dict = {}

    t = time.perf_counter()
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, cuda_graph_config=None, kv_cache_config=kv_cfg)
    base = llm.generate([prompt], params)[0].outputs[0].token_ids
    result["baseline_s"] = round(time.perf_counter() - t, 1)
    llm.shutdown()

    result.update(_backend(model_dir, tokenizer, items, trace))
    got = result["connector_tokens"]
    fills = trace.read_text().split("\n") if trace.exists() else []
    result.update(baseline_tokens=list(base), token_agreement=sum(a == b for a, b in zip(base, got)) / max(1, len(base)),
                  fills=[f for f in fills if f])
    result["ok"] = bool(result["fills"]) and got[:1] == list(base[:1]) and not result["other_tenant_filled"]
    Path(out_json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def _backend(model_dir: Path, tokenizer, items, trace: Path) -> dict:
    """The engine seam: TrtllmBackend (what ``serve --engine trtllm`` runs) over TensorRT-LLM with the connector.
    tenant-a asks in kv mode (the backend writes the plan and its salt); tenant-b then sends the very same token ids
    while tenant-a's plan is still held and must get no injected pages."""
    import threading

    from transformers import AutoModelForCausalLM

    from inferscale.engine import Engine
    from inferscale.engine.loop import DoneEvent, ErrorEvent, GenRequest, TokenEvent
    from inferscale.engine.sampling import Sampling
    from inferscale.models.loader import from_model
    from inferscale.trtllm.backend import TrtllmBackend, TrtllmOptions

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
    engine = Engine(from_model(model, tokenizer, name="smoke-llama", weights_digest="smoke"))
    blocks = engine.encode(items)
    backend = TrtllmBackend(engine, TrtllmOptions(model=str(model_dir), tokens_per_block=16,
                                                  free_gpu_memory_fraction=0.2))

    def ask(tenant: str, mode: str) -> tuple[GenRequest, list]:
        events, done = [], threading.Event()

        def emit(ev):
            events.append(ev)
            if isinstance(ev, DoneEvent | ErrorEvent):
                done.set()

        req = GenRequest(ids=engine.question_ids("where did caroline go in may?"), blocks=list(blocks), mode=mode,
                         sampling=Sampling(max_new_tokens=8, ignore_eos=True), emit=emit, tenant=tenant)
        backend.submit(req)
        assert done.wait(120), f"{tenant}: no answer in 120 s"
        return req, events

    def fills() -> int:
        return len(trace.read_text().splitlines()) if trace.exists() else 0

    try:
        req, events = ask("tenant-a", "kv")
        result = {"connector_s": round(time.perf_counter() - t, 1), "prompt_tokens": events[-1].prompt_tokens,
                  "connector_error": repr(events[-1].error) if isinstance(events[-1], ErrorEvent) else None,
                  "connector_tokens": [e.token_id for e in events
                                       if isinstance(e, TokenEvent) and e.token_id is not None]}
        prompt, entry = backend._layout(req)
        backend._hold(prompt, entry)  # tenant-a's plan stays in place while tenant-b asks
        before = fills()
        ask("tenant-b", "text")
        result["other_tenant_filled"] = fills() > before
    finally:
        backend.close()
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "trtllm-smoke.json"))
