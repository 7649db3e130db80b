"""Model fingerprint: what a KV block is valid for (config + weights identity + tokenizer)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

# Config keys that change nothing about the numbers a model computes.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "quantization_config", "torch_dtype", "dtype",
                         "architectures", "use_cache", "output_attentions", "output_hidden_states"}


def config_digest(config) -> str:
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_digest(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    blob = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a weights file, cached beside it by (size, mtime) so a 1 GB file is hashed once."""
    path = Path(path)
    st = path.stat()
    cache = path.with_name(f".{path.name}.sha256")
    key = f"{st.st_size}:{st.st_mtime_ns}"
    try:
        cached_key, digest = cache.read_text().split()
        if cached_key == key:
            return digest
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    digest = h.hexdigest()
    try:
        cache.write_text(f"{key} {digest}\n")
    except OSError:
        pass  # read-only model dirs are fine: we just hash again next time
    return digest


def weights_digest_from_tensors(model: torch.nn.Module) -> str:
    """For in-memory models (tests' random weights): hash the parameters themselves."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def fingerprint(config, weights_digest: str, tokenizer) -> str:
    h = hashlib.sha256()
    for part in (config_digest(config), weights_digest, tokenizer_digest(tokenizer)):
        h.update(part.encode())
    return h.hexdigest()
