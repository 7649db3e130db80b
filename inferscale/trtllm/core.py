"""The TensorRT-LLM connector's plain-Python core: span planning, block alignment, cache salt, the pool fill.

TensorRT-LLM reuses KV by prefix only, so a request's prompt is laid out as
    [shared prefix][memory span: block 1 .. block k][question]
and the connector claims, as "matched" tokens, everything from what TensorRT-LLM already holds on device up to the
last whole KV-cache page that ends inside [prefix][memory span]. Those pages are filled from the store (prefix
copied, memory keys rotated by Δ to where they now sit); the rest (a partial page, the question) is prefilled by
the engine as usual. No ``tensorrt_llm`` import here: this runs and is tested on CPU against a pool tensor.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from inferscale.contract import is_valid_tenant
from inferscale.errors import ConfigError
from inferscale.kernels.inject import shift_and_place

_SALT_DOMAIN = b"inferscale/trtllm-cache-salt/v1\x00"
MIN_SECRET_BYTES = 16


def cache_salt(secret: bytes, tenant: str) -> str:
    """The ``cache_salt`` a tenant's requests carry: HMAC-SHA256(secret, domain ‖ tenant), hex.

    TensorRT-LLM only reuses KV between requests with the same salt. Injected memory KV is approximate (it is not
    what a prefill of those tokens computes), so it must never satisfy another tenant's exact-prefix lookup: one
    salt per tenant, unguessable without the server secret, distinct for distinct tenants."""
    if not isinstance(secret, bytes | bytearray) or len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"cache salt secret must be at least {MIN_SECRET_BYTES} bytes")
    if not is_valid_tenant(tenant):
        raise ConfigError(f"tenant {tenant!r} is not a valid tenant name")
    return hmac.new(bytes(secret), _SALT_DOMAIN + tenant.encode(), hashlib.sha256).hexdigest()


def salt_allows(plan_salt: str, request_salt_id: int | None, salt_id: Callable[[str], int]) -> bool:
    """May a request use a plan? Only when it carries the plan's salt. TensorRT-LLM hands the connector a
    request's salt as an id (``salt_id``, its own hash of the salt string), so the plan's salt is hashed the same
    way and compared. A plan with no salt, or a request with none, never matches: a prompt that merely repeats
    another tenant's token ids must not receive that tenant's injected KV."""
    if not plan_salt or request_salt_id is None:
        return False
    return hmac.compare_digest(str(salt_id(plan_salt)), str(request_salt_id))


@dataclass(frozen=True)
class BlockPlacement:
    """One memory block in the prompt: ``length`` tokens that were encoded at ``encoded_at``.. and now sit at
    ``position``.. (so its keys rotate by ``position - encoded_at``)."""

    length: int
    encoded_at: int
    position: int

    @property
    def delta(self) -> int:
        return self.position - self.encoded_at


@dataclass(frozen=True)
class SpanPlan:
    """Where the pieces of one request's prompt lie, and how much of it the connector can supply."""

    prefix_len: int
    blocks: tuple[BlockPlacement, ...]
    question_len: int
    tokens_per_block: int

    @property
    def memory_end(self) -> int:
        return self.prefix_len + sum(b.length for b in self.blocks)

    @property
    def total(self) -> int:
        return self.memory_end + self.question_len

    @property
    def claim_end(self) -> int:
        """The last page boundary inside [prefix][memory span] that still leaves at least one prompt token for the
        engine to prefill (it needs one to produce logits)."""
        tpb = self.tokens_per_block
        return min(self.memory_end // tpb * tpb, (self.total - 1) // tpb * tpb)

    def num_new_matched_tokens(self, num_computed_tokens: int) -> int:
        """What ``get_num_new_matched_tokens`` answers: tokens after those TensorRT-LLM already holds. 0 when its
        match ends mid-page (pages are filled whole) or already covers the claim."""
        if num_computed_tokens < 0:
            raise ConfigError(f"num_computed_tokens {num_computed_tokens} < 0")
        if num_computed_tokens % self.tokens_per_block:
            return 0
        return max(0, self.claim_end - num_computed_tokens)

    def sources(self, start: int, end: int) -> tuple[list[int], list[int], list[int]]:
        """For positions start..end-1: (token in the staging buffer [prefix][block 1]..[block k], position, Δ).
        The staging buffer is the prefix then the blocks in prompt order, so token index == position."""
        if not 0 <= start <= end <= self.memory_end:
            raise ConfigError(f"fill range {start}..{end} outside [0, {self.memory_end}]")
        positions = list(range(start, end))
        deltas = [0] * len(positions)
        for b in self.blocks:
            lo, hi = max(b.position, start), min(b.position + b.length, end)
            for p in range(lo, hi):
                deltas[p - start] = b.delta
        return positions, positions, deltas


def plan_span(prefix_len: int, blocks: Sequence[tuple[int, int]], question_len: int,
              tokens_per_block: int) -> SpanPlan:
    """Lay out [prefix][blocks][question]: ``blocks`` as (num_tokens, encoded start position), in prompt order."""
    if tokens_per_block < 1:
        raise ConfigError(f"tokens_per_block {tokens_per_block} < 1")
    if prefix_len < 0 or question_len < 1:
        raise ConfigError(f"prefix_len {prefix_len} / question_len {question_len}: a question needs a token")
    placed, pos = [], prefix_len
    for length, encoded_at in blocks:
        if length < 1 or encoded_at < 0:
            raise ConfigError(f"memory block of {length} tokens encoded at {encoded_at}")
        placed.append(BlockPlacement(length=length, encoded_at=encoded_at, position=pos))
        pos += length
    return SpanPlan(prefix_len, tuple(placed), question_len, tokens_per_block)


def pool_view(kv_cache_tensor: torch.Tensor, kv_heads: int, head_dim: int, tokens_per_block: int) -> torch.Tensor:
    """TensorRT-LLM's registered pool [num_blocks, layers, 2, kv_heads·tokens_per_block·head_dim] viewed as
    [num_blocks, layers, 2, kv_heads, tokens_per_block, head_dim] (its per-page HND layout). No copy."""
    if kv_cache_tensor.dim() == 6:
        return kv_cache_tensor
    nb, nl, kvf = kv_cache_tensor.shape[:3]
    if kvf != 2 or kv_cache_tensor[0, 0, 0].numel() != kv_heads * tokens_per_block * head_dim:
        raise ConfigError(f"KV pool {tuple(kv_cache_tensor.shape)} does not hold K and V pages of "
                          f"{kv_heads}x{tokens_per_block}x{head_dim}")
    return kv_cache_tensor.view(nb, nl, 2, kv_heads, tokens_per_block, head_dim)


def zero_pages(kv_cache_tensor: torch.Tensor, page_table: Sequence[int], start: int, end: int,
               tokens_per_block: int) -> None:
    """Zero the pages that hold positions start..end-1 (a claim the connector cannot fill): TensorRT-LLM will
    attend to them as matched tokens, so they must not keep what an earlier request, maybe another tenant's, left
    there. Works on the registered tensor in any layout (pages first)."""
    first, last = start // tokens_per_block, -(-end // tokens_per_block)
    pages = list(page_table[first:last])
    if pages:
        kv_cache_tensor[torch.tensor(pages, device=kv_cache_tensor.device)] = 0


def fill_pool(pool: torch.Tensor, page_table: Sequence[int], plan: SpanPlan, prefix_kv: torch.Tensor,
              block_kvs: Sequence[torch.Tensor], groups: Sequence[tuple[Sequence[int], torch.Tensor]],
              start: int, end: int) -> None:
    """Write positions start..end-1 of [prefix][memory span] into a request's pages of ``pool``.

    pool [num_pages, layers, 2, H, tokens_per_block, D]; page_table: the request's pages in sequence order;
    prefix_kv [layers, 2, H, prefix_len, D]; block_kvs[i] [layers, 2, H, blocks[i].length, D]; groups: (layer
    indices, inv_freq) per RoPE θ (``ModelLayout.freq_groups().values()``). One staging copy to the pool's device,
    then one ``shift_and_place`` per layer group (the fused kernel on CUDA)."""
    if len(block_kvs) != len(plan.blocks):
        raise ConfigError(f"{len(block_kvs)} block tensors for a plan of {len(plan.blocks)} blocks")
    if prefix_kv.shape[3] != plan.prefix_len:
        raise ConfigError(f"prefix KV holds {prefix_kv.shape[3]} tokens, the plan {plan.prefix_len}")
    for kv, b in zip(block_kvs, plan.blocks):
        if kv.shape[3] != b.length:
            raise ConfigError(f"a block tensor holds {kv.shape[3]} tokens, the plan {b.length}")
        if not kv.is_floating_point() or kv.dtype == torch.float8_e4m3fn:
            # Compact codes cat'ed with float KV would be read as values: pass ``KVBlock.float_kv()``.
            raise ConfigError(f"a block tensor is {kv.dtype}: compact blocks go in as block.float_kv()")
    if end <= start:
        return
    if start % plan.tokens_per_block or (end % plan.tokens_per_block and end != plan.memory_end):
        raise ConfigError(f"fill {start}..{end} is not page aligned ({plan.tokens_per_block} tokens per page)")
    staging = torch.cat([prefix_kv, *block_kvs], dim=3).to(pool.device)  # the request's "tier buffer"
    src_tokens, positions, deltas = plan.sources(start, end)
    for layers, inv_freq in groups:
        shift_and_place(staging, pool, src_layers=list(layers), dst_layers=list(layers), src_tokens=src_tokens,
                        dst_positions=positions, deltas=deltas, inv_freq=inv_freq, page_table=list(page_table),
                        tokens_per_page=plan.tokens_per_block)
