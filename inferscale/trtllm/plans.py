"""Injection plans handed from the serving process to the connector, keyed by the prompt's token ids.

The server builds the prompt [prefix][memories][question] and knows which blocks it injects; TensorRT-LLM's
scheduler only sees a request's token ids, in its executor process. The server therefore writes the plan (prefix
KV, block KV and where each block was encoded, the layer groups' θ) under a directory keyed by sha256 of the token
ids, and the connector reads it back: one file, written atomically, no shared memory between the processes.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from inferscale.errors import ConfigError


@dataclass
class InjectionEntry:
    prefix_kv: torch.Tensor  # [layers, 2, H, prefix_len, D]
    block_kvs: list[torch.Tensor]  # each [layers, 2, H, tokens, D], in prompt order
    encoded_at: list[int]  # first position each block was encoded at
    groups: list[tuple[list[int], torch.Tensor]]  # (layer indices, inv_freq) per RoPE θ
    salt: str = ""  # the cache_salt the request must carry (core.cache_salt of its tenant); "" never matches

    @property
    def blocks(self) -> list[tuple[int, int]]:
        return [(kv.shape[3], at) for kv, at in zip(self.block_kvs, self.encoded_at)]


def prompt_key(token_ids: Sequence[int], salt_id: int | None = None) -> str:
    """sha256 of the token ids, with TensorRT-LLM's id of the request's cache salt mixed in when given: two tenants
    sending the same token ids have two plans (the connector sees the salt id with the tokens at match time)."""
    h = hashlib.sha256(b"" if salt_id is None else b"salt-id:%d\x00" % salt_id)
    h.update(torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


class PlanRegistry:
    """A directory of injection plans (``INFERSCALE_TRTLLM_PLAN_DIR``), e.g. on a tmpfs both processes see."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ConfigError(f"plan directory {self.dir} does not exist")

    def put(self, token_ids: Sequence[int], entry: InjectionEntry, salt_id: int | None = None) -> str:
        if len(entry.block_kvs) != len(entry.encoded_at):
            raise ConfigError("one encoded position per block")
        key = prompt_key(token_ids, salt_id)
        payload = {"prefix_kv": entry.prefix_kv.cpu(), "block_kvs": [b.cpu() for b in entry.block_kvs],
                   "encoded_at": list(entry.encoded_at),
                   "groups": [(list(layers), f.cpu()) for layers, f in entry.groups], "salt": entry.salt}
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        os.close(fd)
        torch.save(payload, tmp)
        os.replace(tmp, self.dir / f"{key}.pt")  # atomic: a reader never sees half a plan
        return key

    def get(self, token_ids: Sequence[int], salt_id: int | None = None) -> InjectionEntry | None:
        return self.load(prompt_key(token_ids, salt_id))

    def load(self, key: str) -> InjectionEntry | None:
        path = self.dir / f"{key}.pt"
        if not path.is_file():
            return None
        p = torch.load(path, map_location="cpu", weights_only=True)  # tensors and lists only: no pickled code
        return InjectionEntry(p["prefix_kv"], list(p["block_kvs"]), list(p["encoded_at"]),
                              [(list(layers), f) for layers, f in p["groups"]], p.get("salt", ""))

    def discard(self, key: str) -> None:
        (self.dir / f"{key}.pt").unlink(missing_ok=True)
        (self.dir / f"{key}.failed").unlink(missing_ok=True)

    # A load the connector could not make (plan gone, salt refused): TensorRT-LLM already counts those tokens as
    # matched, so the connector zeroes the pages and leaves a marker; the serving side fails that request alone.
    def mark_failed(self, key: str, reason: str) -> None:
        (self.dir / f"{key}.failed").write_text(reason)

    def failure(self, key: str) -> str | None:
        path = self.dir / f"{key}.failed"
        try:
            return path.read_text() or "failed"
        except FileNotFoundError:
            return None
