"""The serving loop's fault boundary (issue 20): an exception while admitting, prefilling, decoding or sampling one
request fails that request alone and the step goes on for the others; a batched decode pass that fails is run
again row by row. An exception out of a step ends the worker, which then answers every request at once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tiny_models as tm
from inferscale.engine import Sampling
from inferscale.engine import loop as loop_mod
from inferscale.engine.loop import DoneEvent, ErrorEvent, GenRequest, ServingLoop, TokenEvent
from inferscale.engine.worker import EngineWorker
from inferscale.errors import EngineUnavailableError, InvalidInputError


@pytest.fixture(scope="module")
def engine():
    return tm.engine("llama")


QUESTIONS = ["where did caroline go?", "what did melanie paint?", "who has a dog?"]


def _req(engine, question: str, tenant: str, tokens: int = 6, **kw) -> tuple[GenRequest, list]:
    events: list = []
    r = GenRequest(ids=engine.question_ids(question), blocks=[], mode="none", tenant=tenant, emit=events.append,
                   sampling=Sampling(max_new_tokens=tokens, ignore_eos=True, **kw))
    return r, events


def _tokens(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id is not None]


def _run(engine, broken: str | None = None, **sampling) -> dict[str, list]:
    """Each question as its own tenant's request in one loop; the request for ``broken`` carries a marker."""
    loop = ServingLoop(engine)
    out = {}
    for i, q in enumerate(QUESTIONS):
        r, events = _req(engine, q, f"t{i}", **sampling)
        r.broken = q == broken  # read by the faults patched in below
        loop.add(r)
        out[q] = events
    loop.run_until_done()
    assert loop.rows == [] and loop.decoding == 0 and not loop.has_work()
    return out


def _assert_only_broken_failed(out: dict[str, list], clean: dict[str, list], broken: str) -> None:
    for q, events in out.items():
        if q == broken:
            assert isinstance(events[-1], ErrorEvent) and not any(isinstance(e, DoneEvent) for e in events)
        else:  # the others answer exactly what they answer with no broken neighbour
            assert isinstance(events[-1], DoneEvent), events[-1]
            assert _tokens(events) == _tokens(clean[q])


def test_a_sampling_error_fails_that_request_alone(engine, monkeypatch):
    clean = _run(engine, temperature=0.7, seed=3)  # requests that sample: a greedy token is an argmax, no sampler
    real = loop_mod.sample

    def sample(logits, sampling, generator, banned=()):
        if sampling.max_new_tokens == 5:  # the broken request's marker
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, sampling, generator, banned)

    monkeypatch.setattr(loop_mod, "sample", sample)
    loop = ServingLoop(engine)
    reqs = [_req(engine, q, f"t{i}", tokens=5 if i == 1 else 6, temperature=0.7, seed=3)
            for i, q in enumerate(QUESTIONS)]
    for r, _ in reqs:
        loop.add(r)
    loop.run_until_done()
    _assert_only_broken_failed({q: ev for q, (_, ev) in zip(QUESTIONS, reqs)}, clean, QUESTIONS[1])
    assert loop.rows == [] and not loop.has_work()


def test_an_admission_error_fails_that_request_alone(engine, monkeypatch):
    clean = _run(engine)
    real = ServingLoop._admit

    def admit(self, req):
        if req.broken:
            raise ValueError("Overflow when unpacking long long")
        real(self, req)

    monkeypatch.setattr(ServingLoop, "_admit", admit)
    _assert_only_broken_failed(_run(engine, QUESTIONS[0]), clean, QUESTIONS[0])


def test_a_prefill_error_fails_that_request_alone(engine, monkeypatch):
    clean = _run(engine)
    real = ServingLoop._prefill_chunk

    def prefill(self, req, n):
        if req.broken:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        real(self, req, n)

    monkeypatch.setattr(ServingLoop, "_prefill_chunk", prefill)
    # each chunk a pass of its own (the path a lone chunk and a failed pass's retry take)
    monkeypatch.setattr(loop_mod, "padded_groups", lambda lengths, **_: [[i] for i in range(len(lengths))])
    _assert_only_broken_failed(_run(engine, QUESTIONS[2]), clean, QUESTIONS[2])


def test_a_failed_batched_prompt_pass_is_retried_chunk_by_chunk(engine, monkeypatch):
    clean = _run(engine)
    real = ServingLoop._last_rows
    passes = []

    def forward(self, rows, starts, ids, *last):
        if ids.shape[1] > 1:  # a prompt pass
            passes.append(len(rows))
            if any(self.rows[r].broken for r in rows):
                raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return real(self, rows, starts, ids, *last)

    monkeypatch.setattr(ServingLoop, "_last_rows", forward)
    _assert_only_broken_failed(_run(engine, QUESTIONS[0]), clean, QUESTIONS[0])
    n = len(QUESTIONS)
    assert passes[0] == n and passes[1:n + 1] == [1] * n  # together, then each alone


def test_a_failed_batched_decode_is_retried_without_the_row_that_broke_it(engine, monkeypatch):
    clean = _run(engine)
    real = ServingLoop._last_rows
    batched = []

    def forward(self, rows, starts, ids, *last):
        if any(self.rows[r].broken for r in rows) and ids.shape[1] == 1:  # a decode pass holding the broken row
            batched.append(len(rows))
            raise RuntimeError("device-side assert triggered (simulated)")
        return real(self, rows, starts, ids, *last)

    monkeypatch.setattr(ServingLoop, "_last_rows", forward)
    out = _run(engine, QUESTIONS[1])
    _assert_only_broken_failed(out, clean, QUESTIONS[1])
    assert batched[0] >= 2 and 1 in batched  # a batch with others failed, then the row alone
    assert len(_tokens(out[QUESTIONS[1]])) == 1  # its first token came from its prompt pass


def test_a_seed_outside_int64_is_refused_before_the_loop():
    with pytest.raises(InvalidInputError) as e:
        Sampling(seed=2**64)
    assert e.value.param == "seed"


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_a_temperature_below_the_floor_is_greedy(engine, temperature):
    assert Sampling(temperature=temperature).temperature == 0.0
    greedy, tiny = _run(engine), _run(engine, temperature=temperature, seed=1)
    assert {q: _tokens(e) for q, e in tiny.items()} == {q: _tokens(e) for q, e in greedy.items()}


def test_a_tiny_temperature_is_raised_to_the_floor():
    assert Sampling(temperature=1e-3).temperature == 1e-2 and Sampling(temperature=0.7).temperature == 0.7


def test_a_failed_worker_answers_every_request_at_once_and_refuses_new_ones(engine):
    """What a bug outside every request's boundary does: the worker is dead, and says so at once."""
    worker = EngineWorker(engine)
    release = threading.Event()

    def broken_step():
        release.wait(10)
        raise RuntimeError("a bug in the loop (simulated)")

    worker.loop.step = broken_step
    streams = []
    for i, q in enumerate(QUESTIONS * 2):
        r, events = _req(engine, q, f"t{i % 2}")
        worker.submit(r)
        streams.append(events)
    assert worker.alive and worker.queued == 6
    release.set()
    t0 = time.monotonic()
    assert worker.died.wait(2)
    deadline = t0 + 2
    while not all(streams) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(len(ev) == 1 and isinstance(ev[0], ErrorEvent) for ev in streams)
    assert all(isinstance(ev[0].error, EngineUnavailableError) for ev in streams)
    assert not worker.alive
    with pytest.raises(EngineUnavailableError):
        worker.submit(_req(engine, QUESTIONS[0], "late")[0])
    worker.close(1)


def test_sampling_draws_from_the_distribution_and_survives_non_finite_logits():
    from inferscale.engine.sampling import sample

    logits = torch.log(torch.tensor([0.8, 0.2, 0.0]))
    g = torch.Generator().manual_seed(5)
    draws = [sample(logits, Sampling(temperature=1.0), g) for _ in range(4000)]
    assert 2 not in draws and abs(draws.count(0) / len(draws) - 0.8) < 0.03
    again = torch.Generator().manual_seed(5)
    assert [sample(logits, Sampling(temperature=1.0), again) for _ in range(50)] == draws[:50]  # seeded: repeatable
    for bad in (torch.tensor([float("nan")] * 3), torch.tensor([float("inf"), 0.0, float("-inf")]),
                torch.full((3,), float("-inf"))):
        assert sample(bad, Sampling(temperature=1.0, top_p=0.5), g) in (0, 1, 2)  # no device-side assert to trip
