"""Small synthetic blocks for store tests (no model needed)."""

from __future__ import annotations

import torch

from inferscale.kvformat import KVBlock

from fleet_certs import shared_fleet_tls

FP = "f" * 64  # a model fingerprint
ITEMS = [f"m{i}" for i in range(6)]  # acme/alice's memories on the peer_node fixture (conftest.py)
OTHER_FP = "e" * 64
PEER_SECRET = "peer-secret-for-store-tests"  # INFERSCALE_PEER_SECRET of every test node
PEER_TLS = shared_fleet_tls()  # every test node's peer channel is TLS, as the chart's fleet is
LAYERS, HEADS, DIM = 2, 1, 2048  # 4 tokens -> 128 KiB of kv: above the store's 64 KiB block floor


def make_block(item: str, tokens: int = 4, *, version: int = 0, fp: str = FP, seed: int | None = None,
               embed: bool = True) -> KVBlock:
    """A block whose kv is deterministic in (item, version, seed), so any mix-up is detectable."""
    g = torch.Generator().manual_seed(seed if seed is not None else hash((item, version)) & 0xFFFFFFFF)
    kv = torch.randn(LAYERS, 2, HEADS, tokens, DIM, generator=g)
    kv[0, 0, 0, 0, 0] = float(version)  # the version is readable from the tensor itself
    return KVBlock(
        item_id=item, text=f"{item} v{version}", token_ids=list(range(tokens)), start_pos=7, kv=kv,
        model_fingerprint=fp, prefix_sha256="p" * 64, timestamp="2023-05-08",
        embedding=torch.randn(16, generator=g) if embed else None,
    )


def blob_bytes(tokens: int = 4) -> int:
    """Approximate blob size of make_block (kv + header); for budgets."""
    return LAYERS * 2 * HEADS * tokens * DIM * 4 + 4096
