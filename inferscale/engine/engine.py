"""The engine: encode memories once, then answer with them injected (``kv``), pasted (``text``) or absent (``none``).

The hot path (``prefill``) reads top to bottom:
  text  prefix KV (cached, like any prefix cache) → prefill every memory token and the query
  kv    prefix KV + blocks rotated into place      → prefill only the query
  none  prefix KV                                  → prefill only the query
  kv-recompute: kv, then re-run a chosen fraction of memory tokens with full context (see recompute.py)
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from inferscale.contract import DEFAULT_KV_DTYPE, DEFAULT_RECOMPUTE_RATIO, MODES
from inferscale.engine.cache import cache_from_kv, injected_cache, kv_of_cache
from inferscale.engine.loop import DoneEvent, ErrorEvent, GenRequest, ServingLoop, TokenEvent
from inferscale.engine.sampling import Sampling, sample
from inferscale.engine.slots import FIRST_CAPACITY, FIRST_SLOTS
from inferscale.engine.scheduler import SchedulerConfig
from inferscale.engine.encoder import DEFAULT_CONTEXT_ITEMS, DEFAULT_CONTEXT_TOKENS, encode_items
from inferscale.engine.threads import configure_threads
from inferscale.engine.template import DEFAULT_TEMPLATE, MemoryItem, PromptTemplate
from inferscale.errors import ConfigError, InvalidInputError, MemoryItemError, FingerprintMismatchError, PromptTooLongError
from inferscale.kvformat import KVBlock, list_blobs, load_block
from inferscale.kvquant import check_kv_dtype, stored_bytes_per_token
from inferscale.models.loader import LoadedModel, load_model



@dataclass
class Sequence:
    """One request in flight: its cache, how many tokens it holds, and the logits for the next token."""

    cache: DynamicCache
    length: int
    logits: torch.Tensor  # [vocab] float32
    prompt_tokens: int
    memory_tokens: int
    generated: list[int] = field(default_factory=list)


@dataclass
class Answer:
    text: str
    token_ids: list[int]  # generated: an end-of-sequence token excluded, the one completing a stop sequence kept
    first_token: int  # the first token chosen, stop token included (what agreement between modes compares)
    ttft_s: float
    total_s: float
    prompt_tokens: int
    memory_tokens: int
    mode: str
    first_logits: torch.Tensor | None = None  # [vocab] float32, only when asked for (keep_first_logits)


class Engine:
    def __init__(self, loaded: LoadedModel, template: PromptTemplate = DEFAULT_TEMPLATE, *,
                 context_items: int = DEFAULT_CONTEXT_ITEMS, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                 kv_dtype: str = DEFAULT_KV_DTYPE) -> None:
        if context_items < 0 or context_tokens < 0:
            raise ConfigError(f"context of {context_items} items / {context_tokens} tokens: expected 0 or more")
        # The format new blocks are stored in (kvquant); blocks of any format are injected.
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.loaded = loaded
        self.template = template
        # How much of the preceding memories each item is encoded behind (see encoder.py).
        self.context_items, self.context_tokens = context_items, context_tokens
        self.tokenizer = loaded.tokenizer
        self.prefix_ids: list[int] = self.tokenizer(template.prefix, add_special_tokens=True).input_ids
        if self.tokenizer.bos_token_id is not None and self.prefix_ids[:1] != [self.tokenizer.bos_token_id]:
            self.prefix_ids = [self.tokenizer.bos_token_id, *self.prefix_ids]
        # Blocks are valid only after this exact prefix on this exact model.
        self.prefix_sha256 = hashlib.sha256(
            (loaded.fingerprint + json.dumps(self.prefix_ids)).encode()
        ).hexdigest()
        self.prefix_kv = self._prefill_prefix()
        self._loop: ServingLoop | None = None  # ask()'s own loop, made on first use
        vocab = self.tokenizer.get_vocab()
        # Tokens that contain a line break: literal (SentencePiece), byte-level "Ċ" (GPT-2 style) or a byte token.
        self.newline_ids = {i for t, i in vocab.items() if "\n" in t or "Ċ" in t or t == "<0x0A>"}
        self.stop_ids = {i for t, i in vocab.items() if t in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>")}
        if self.tokenizer.eos_token_id is not None:
            self.stop_ids.add(self.tokenizer.eos_token_id)

    @classmethod
    def load(cls, name_or_path: str | None = None, *, device: str | None = None, dtype: str | None = None,
             context_tokens: int = DEFAULT_CONTEXT_TOKENS, kv_dtype: str = DEFAULT_KV_DTYPE,
             threads: int | None = None) -> Engine:
        """Load a model and build its engine; ``threads``: torch's CPU threads (None/0: threads.py's default)."""
        configure_threads(threads)
        return cls(load_model(name_or_path, device=device, dtype=dtype), context_tokens=context_tokens,
                   kv_dtype=kv_dtype)

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    # ---- tokens -------------------------------------------------------------------------------------------
    def item_token_ids(self, item: MemoryItem) -> list[int]:
        return self.tokenizer(self.template.render_item(item), add_special_tokens=False).input_ids

    def question_ids(self, question: str) -> list[int]:
        return self.tokenizer(self.template.render_question(question), add_special_tokens=False).input_ids

    def chat_ids(self, messages: list[tuple[str, str]]) -> list[int]:
        return self.tokenizer(self.template.render_chat(messages), add_special_tokens=False).input_ids

    # ---- memories -----------------------------------------------------------------------------------------
    def encode(
        self,
        items: list[MemoryItem],
        *,
        only: Collection[str] | None = None,
        context_tokens: int | None = None,
        batch_tokens: int = 1024,
        on_progress: Callable[[int], None] | None = None,
        embed: Callable[[list[str]], torch.Tensor] | None = None,
    ) -> list[KVBlock]:
        """One block per item of ``items`` (a user's memories, oldest first), or per item named in ``only`` and per
        item encoded behind one of those; each is encoded behind the memories before it in ``items`` (encoder.py)."""
        return encode_items(self, items, only=only, context_tokens=context_tokens, batch_tokens=batch_tokens,
                            on_progress=on_progress, embed=embed)

    def checked_item_ids(self, item: MemoryItem) -> list[int]:
        """The item's token ids; MemoryItemError if it cannot be encoded (it would not fit the model's context)."""
        ids = self.item_token_ids(item)
        if len(self.prefix_ids) + len(ids) + 1 > self.loaded.layout.max_positions:
            raise MemoryItemError(
                f"memory {item.id!r}: {len(ids)} tokens do not fit the model's context of "
                f"{self.loaded.layout.max_positions}"
            )
        return ids

    def check_block(self, block: KVBlock, source: str = "block") -> None:
        if block.model_fingerprint != self.loaded.fingerprint:
            raise FingerprintMismatchError(f"{source} (item {block.item_id!r}): encoded for another model")
        if block.prefix_sha256 != self.prefix_sha256:
            raise FingerprintMismatchError(f"{source} (item {block.item_id!r}): encoded after another memory prefix")

    def load_blocks(self, paths: Path | list[Path]) -> list[KVBlock]:
        """Load and verify blobs (a directory or a list of files) for this model."""
        if isinstance(paths, (str, Path)):
            paths = list_blobs(Path(paths))
        return [
            load_block(p, expect_fingerprint=self.loaded.fingerprint, expect_prefix=self.prefix_sha256) for p in paths
        ]

    # ---- prefill ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, query_ids: list[int], blocks: list[KVBlock], mode: str = "kv", *, recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
        reserve_tokens: int = 0,
    ) -> Sequence:
        if mode not in MODES:
            raise InvalidInputError(f"mode {mode!r}: expected one of {', '.join(MODES)}", param="mode")
        if mode == "none":
            blocks = []
        for b in blocks:
            self.check_block(b)
        p = len(self.prefix_ids)
        memory_tokens = sum(b.num_tokens for b in blocks)
        total = p + memory_tokens + len(query_ids)
        if total + reserve_tokens > self.loaded.layout.max_positions:
            raise PromptTooLongError(
                f"prompt of {total} tokens + {reserve_tokens} to generate exceeds the model's context of "
                f"{self.loaded.layout.max_positions}"
            )
        if not query_ids:
            raise InvalidInputError("empty query", param="messages")
        config = self.loaded.model.config
        if mode == "text":
            cache = cache_from_kv(self.prefix_kv, config)
            ids = [t for b in blocks for t in b.token_ids] + list(query_ids)
            logits = self.forward_logits(ids, p, cache)
        elif mode == "kv-recompute" and blocks:
            from inferscale.engine.recompute import prefill_with_recompute

            cache, logits = prefill_with_recompute(self, blocks, query_ids, recompute_ratio)
        else:
            cache = injected_cache(self.prefix_kv, blocks, self.loaded.layout, config)
            logits = self.forward_logits(list(query_ids), p + memory_tokens, cache)
        return Sequence(cache=cache, length=total, logits=logits, prompt_tokens=total, memory_tokens=memory_tokens)

    def forward_logits(self, ids: list[int], start: int, cache: DynamicCache) -> torch.Tensor:
        """Run ``ids`` at positions start.. over ``cache``; logits of the last position only."""
        dev = self.device
        out = self.loaded.model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            position_ids=torch.arange(start, start + len(ids), device=dev)[None],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1].float()

    def _prefill_prefix(self) -> torch.Tensor:
        cache = DynamicCache()
        with torch.inference_mode():
            self.loaded.model.model(
                input_ids=torch.tensor([self.prefix_ids], device=self.loaded.device), cache=cache, use_cache=True
            )
        return kv_of_cache(cache)

    # ---- decode -------------------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
        return sample(logits, sampling, generator)

    @torch.inference_mode()
    def step(self, seq: Sequence, token: int) -> None:
        """Append ``token`` to the sequence and compute the next logits."""
        seq.generated.append(token)
        seq.logits = self.forward_logits([token], seq.length, seq.cache)
        seq.length += 1

    @property
    def kv_token_bytes(self) -> int:
        """What one token's K/V takes in a serving loop's slot pool, uncompressed in the model's dtype (a server's K/V
        budget, in tokens)."""
        layout = self.loaded.layout
        return stored_bytes_per_token("bf16", layers=len(layout.layers), kv_heads=layout.num_kv_heads,
                                      head_dim=layout.head_dim, float_dtype=self.prefix_kv.dtype)

    def serving_loop(self, config: SchedulerConfig | None = None, *, slots: int = FIRST_SLOTS,
                     slot_tokens: int = FIRST_CAPACITY) -> ServingLoop:
        """A serving loop over this engine (the server's worker runs one; ``ask`` runs its own), its slot pool
        starting at ``slots`` x ``slot_tokens`` (``slots.py``)."""
        return ServingLoop(self, config, slots=slots, slot_tokens=slot_tokens)

    def ask(
        self, question: str | list[int], blocks: list[KVBlock], mode: str = "kv", *, sampling: Sampling | None = None,
        recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO, keep_first_logits: bool = False,
    ) -> Answer:
        """One request through the serving loop, the path the server runs. TTFT ends when the first token is
        chosen."""
        sampling = sampling or Sampling()
        query = self.question_ids(question) if isinstance(question, str) else list(question)
        events: list = []
        if self._loop is None:
            self._loop = self.serving_loop()
        t0 = time.perf_counter()
        req = GenRequest(ids=query, blocks=blocks, mode=mode, sampling=sampling, emit=events.append,
                         recompute_ratio=recompute_ratio, keep_first_logits=keep_first_logits)
        self._loop.add(req)
        self._loop.run_until_done()
        total = time.perf_counter() - t0
        if isinstance(events[-1], ErrorEvent):
            raise events[-1].error
        done: DoneEvent = events[-1]
        tokens = [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id is not None]
        first_t = next((e.t for e in events if isinstance(e, TokenEvent)), t0 + total)
        return Answer(
            text="".join(e.text for e in events if isinstance(e, TokenEvent)).strip(),
            token_ids=tokens,
            first_token=done.first_token,
            ttft_s=first_t - t0 if tokens else total,
            total_s=total,
            prompt_tokens=done.prompt_tokens,
            memory_tokens=done.memory_tokens,
            mode=mode,
            first_logits=req.first_logits,
        )
