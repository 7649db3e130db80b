"""TensorRT-LLM connector smoke test: needs a CUDA GPU and ``tensorrt_llm`` (run by scripts/gpu-check.sh).

A small random-weight Llama is written as an HF directory; InferScale encodes memories with it and registers the
plan for the prompt [prefix][memories][question]; TensorRT-LLM then generates the same prompt twice:
  baseline   no connector: TensorRT-LLM prefills every token itself
  connector  InferScaleConnector fills the page-aligned [prefix][memories] pages from the plan (blocks injected
             in their encoding order, so Δ = 0 and the injected KV is what a prefill computes)
and the greedy tokens are compared. The trace file proves the connector filled pages, and that the same prompt
under another tenant's cache_salt got none. Writes JSON to argv[1].
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
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig
    from transformers import AutoModelForCausalLM, LlamaConfig

    from inferscale.engine import Engine, MemoryItem
    from inferscale.models.loader import from_model, load_model
    from inferscale.trtllm import InjectionEntry, PlanRegistry, cache_salt

    work = Path(tempfile.mkdtemp(prefix="inferscale-trtllm-"))
    plan_dir, trace = work / "plans", work / "trace.txt"
    plan_dir.mkdir()
    os.environ["INFERSCALE_TRTLLM_PLAN_DIR"] = str(plan_dir)  # TensorRT-LLM's workers inherit these
    os.environ["INFERSCALE_TRTLLM_TRACE"] = str(trace)

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
    groups = [(list(layers), inv_freq) for layers, inv_freq in engine.loaded.layout.freq_groups().values()]
    salt = cache_salt(b"smoke-test-secret-0123456789", "tenant-a")
    PlanRegistry(plan_dir).put(prompt, InjectionEntry(engine.prefix_kv, [b.kv for b in blocks],
                                                      [b.start_pos for b in blocks], groups, salt))
    del engine, model
    torch.cuda.empty_cache()

    params = SamplingParams(max_tokens=8, temperature=0.0)
    kv_cfg = KvCacheConfig(enable_block_reuse=True, tokens_per_block=16, free_gpu_memory_fraction=0.2)
    result: dict = {"prompt_tokens": len(prompt)}

    t = time.perf_counter()
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, cuda_graph_config=None, kv_cache_config=kv_cfg)
    base = llm.generate([prompt], params)[0].outputs[0].token_ids
    result["baseline_s"] = round(time.perf_counter() - t, 1)
    llm.shutdown()

    t = time.perf_counter()
    connector = KvCacheConnectorConfig(connector_module="inferscale.trtllm.connector",
                                       connector_scheduler_class="InferScaleConnectorScheduler",
                                       connector_worker_class="InferScaleConnectorWorker")
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, cuda_graph_config=None, kv_cache_config=kv_cfg,
              kv_connector_config=connector)
    got = llm.generate([prompt], params, cache_salt=salt)[0].outputs[0].token_ids
    result["connector_s"] = round(time.perf_counter() - t, 1)
    fills_before = len(trace.read_text().splitlines()) if trace.exists() else 0
    # Another tenant sending the very same token ids must not receive tenant-a's injected pages.
    other = cache_salt(b"smoke-test-secret-0123456789", "tenant-b")
    llm.generate([prompt], params, cache_salt=other)
    result["other_tenant_filled"] = (len(trace.read_text().splitlines()) if trace.exists() else 0) > fills_before
    llm.shutdown()

    fills = trace.read_text().split("\n") if trace.exists() else []
    result.update(baseline_tokens=list(base), connector_tokens=list(got),
                  token_agreement=sum(a == b for a, b in zip(base, got)) / max(1, len(base)),
                  fills=[f for f in fills if f])
    result["ok"] = bool(result["fills"]) and got[:1] == base[:1] and not result["other_tenant_filled"]
    Path(out_json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "trtllm-smoke.json"))
