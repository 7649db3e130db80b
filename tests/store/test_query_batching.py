"""Retrieval under concurrency (issue 22): a tenant's concurrent queries are embedded in one batch, never with
another tenant's, and each gets its own embedding."""

from __future__ import annotations

import threading

import pytest
import torch

from inferscale.retrieval import Embedder


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


class CountingEmbedder(Embedder):
    """The real embedder, counting its encodes and holding the first one until every caller is queued."""

    def __init__(self, inner: Embedder, callers: int) -> None:  # noqa: D107 - shares the inner model
        self.model, self.dim, self._query_forward = inner.model, inner.dim, inner._query_forward
        self._lock = threading.Lock()
        self._init_query_turns()
        self.batches: list[list[str]] = []
        self.all_queued = threading.Event()
        self.callers = callers

    def _encode_queries(self, texts, features=None):
        if not self.batches:  # the first encode waits until the others have queued behind it
            self.all_queued.wait(10)
        self.batches.append(list(texts))
        return super()._encode_queries(texts, features)

    def embed_query(self, text, group):
        with self._queue_lock:
            waiting = sum(map(len, self._queued.values()))
        if waiting + 1 >= self.callers:
            threading.Timer(0.2, self.all_queued.set).start()
        return super().embed_query(text, group)


def _concurrently(fn, args: list[tuple]) -> list:
    out = [None] * len(args)

    def run(i):
        out[i] = fn(*args[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
        if t is threads[0]:
            t.join(0.3)  # the first caller takes the lock and starts its encode
    for t in threads:
        t.join(30)
    return out


def test_concurrent_queries_of_a_tenant_share_a_batch_and_get_their_own_rows(embedder):
    texts = [f"what did maya do in week {i} of the summer?" for i in range(9)]
    counting = CountingEmbedder(embedder, len(texts))
    got = _concurrently(counting.embed_query, [(t, "tenant-a") for t in texts])
    assert len(counting.batches) == 2 and sorted(sum(counting.batches, [])) == sorted(texts)  # 1 + 8, not 9
    alone = embedder.embed(texts)
    for text, row in zip(texts, got):
        assert torch.allclose(row, alone[texts.index(text)], atol=1e-5)
        assert row.shape == (embedder.dim,)


def test_a_tenants_concurrent_queries_get_the_bits_they_get_alone(embedder):
    """Queries of different lengths queued together are not padded to each other: each embedding is bit for bit
    the one the query gets alone, so a request retrieves the same memories amid its tenant's other requests (a
    padded batch moved the bits, and under load one greedy answer: tests/server/test_answers_under_load.py)."""
    texts = ["where did caroline go camping with her sister last june?", "dog", "the book melanie painted",
             "what did maya do in week 3 of the summer?", "what did maya do in week 4 of the summer?",
             "who moved to paris and why did they move there after the beach trip with the brother?"]
    counting = CountingEmbedder(embedder, len(texts))
    got = _concurrently(counting.embed_query, [(t, "tenant-a") for t in texts])
    assert sum(map(len, counting.batches)) == len(texts) and len(counting.batches) < len(texts)  # some shared
    for text, row in zip(texts, got):
        assert torch.equal(row, embedder._encode_queries([text])[0]), text


def test_another_tenants_queries_never_join_the_batch(embedder):
    args = [("first question of a", "tenant-a")] + [(f"question {i} of b", "tenant-b") for i in range(3)] + \
        [(f"question {i} of a", "tenant-a") for i in range(3)]
    counting = CountingEmbedder(embedder, len(args))
    _concurrently(counting.embed_query, args)
    for batch in counting.batches:
        assert len({"a" if t.endswith(" a") else "b" for t in batch}) == 1, batch


def test_a_caller_taken_along_by_a_failed_encode_embeds_its_own_query(embedder):
    class FailingBatches(CountingEmbedder):
        def _encode_queries(self, texts, features=None):
            if len(texts) > 1:  # the batch of the two callers queued behind the first
                self.batches.append(list(texts))
                raise RuntimeError("this encode fails")
            return super()._encode_queries(texts, features)

    failing = FailingBatches(embedder, 3)
    results = []

    def call(text):
        try:
            results.append(tuple(failing.embed_query(text, "tenant-a").shape))
        except RuntimeError:
            results.append("raised")

    _concurrently(call, [("first",), ("second",), ("third",)])
    # the first alone, the other two together (that encode raises for its caller), then the other caller alone
    assert sorted(map(str, results)) == sorted(map(str, [(embedder.dim,), (embedder.dim,), "raised"]))


def test_queries_get_the_bits_encode_gives_them(embedder):
    """The query path skips ``encode``'s per-call work, not its numbers: alone and in a batch of mixed lengths
    (padded to the longest, as ``encode`` pads the same batch), each row is ``encode``'s bit for bit."""
    texts = ["What is the name of Maya's dog?", "hi", "Where did Maya travel last summer and who went with her?",
             "How did Maya feel about starting her new job at the design studio in Lisbon, and why?"]
    assert torch.equal(embedder._encode_queries(texts), embedder._encode(texts))
    for text in texts:
        assert torch.equal(embedder._encode_queries([text]), embedder._encode([text]))


def test_the_lean_query_pass_is_in_use_where_f32_linear_is(embedder):
    """The bit-for-bit test above checks the lean pass (queryforward.py) only where it is the path taken."""
    from inferscale.kernels import f32_linear

    assert (embedder._query_forward is not None) == (f32_linear.load() is not None)


def test_another_tenants_question_waits_for_one_bounded_batch_not_a_burst(embedder):
    """Tenant A's burst of long questions (each near the model's 256 word pieces) is embedded a question a batch,
    and tenant B's short question, queued behind the whole burst, goes right after the batch in progress: before,
    A's queued burst was one batch that held the encoder while B waited (~0.7 s for 13 such questions beside the
    engine's passes)."""
    from inferscale.retrieval import BATCH_CHARS

    long_ = [f"question {i} of a: " + "what happened at the meeting about the budget and the office move? " * 16
             for i in range(5)]
    assert all(BATCH_CHARS // 2 < len(t) for t in long_)
    args = [(long_[0], "tenant-a")] + [(t, "tenant-a") for t in long_[1:]] + [("where does bob live? b", "tenant-b")]
    counting = CountingEmbedder(embedder, len(args))
    returned_after = {}

    def call(text, group):
        row = counting.embed_query(text, group)
        returned_after[text] = len(counting.batches)  # batches encoded by the time this caller got its row
        return row

    got = _concurrently(call, args)
    assert [len(b) for b in counting.batches] == [1] * 6
    assert counting.batches[1] == ["where does bob live? b"]  # right after the batch that was running
    # and B's caller has its row then, not once A's burst is through (it waited for the encoder's lock before)
    assert returned_after["where does bob live? b"] <= 3
    assert all(row.shape == (embedder.dim,) for row in got)


def test_short_questions_of_a_burst_still_share_a_batch_up_to_its_bound(embedder):
    from inferscale.retrieval import BATCH_CHARS

    texts = [f"what did maya do in week {i} of the summer?" for i in range(40)]
    counting = CountingEmbedder(embedder, len(texts))
    _concurrently(counting.embed_query, [(t, "tenant-a") for t in texts])
    assert len(counting.batches) < len(texts) // 4
    assert all(sum(map(len, b)) <= BATCH_CHARS for b in counting.batches)
