"""The TensorRT-LLM backend of the engine seam on CPU, over the TensorRT-LLM stand-in (tests/trtllm/standin): the
plan handed over, the connector filling pages, the project's model running the forward pass; cancellation, a plan
that vanished, another tenant's salt; and the clear error where TensorRT-LLM is missing."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading

import pytest
import torch

import tiny_models as tm
import trtllm_standin
from inferscale.engine import MemoryItem
from inferscale.engine.loop import DoneEvent, ErrorEvent, GenRequest, TokenEvent
from inferscale.engine.sampling import Sampling
from inferscale.errors import ConfigError, InvalidInputError, TransferError
from inferscale.trtllm.plans import prompt_key


# Pages of 2 tokens: [prefix][memories] ends on a page boundary, so the connector supplies every memory token (with
# pages that end inside the span, the tokens after the last whole page are prefilled by TensorRT-LLM, by design).
TPB = 2


@pytest.fixture(scope="module")
def eng():
    return tm.engine("gemma3")


@pytest.fixture(scope="module")
def blocks(eng):
    encoded = eng.encode([MemoryItem("a", "caroline moved to paris with her dog"),
                          MemoryItem("b", "melanie painted the beach at sunset")])
    return encoded[::-1]  # out of their encoding order: each block's keys are rotated into place (Δ != 0)


@pytest.fixture
def backend(eng, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSCALE_TRTLLM_TRACE", str(tmp_path / "trace"))
    with trtllm_standin.installed() as trt:
        from inferscale.trtllm.backend import TrtllmBackend, TrtllmOptions

        trt.register_model("tiny", eng)
        b = TrtllmBackend(eng, TrtllmOptions(model="tiny", tokens_per_block=TPB))
        yield b
        b.close()
    os.environ.pop("INFERSCALE_TRTLLM_PLAN_DIR", None)


class Events:
    def __init__(self) -> None:
        self.items: list = []
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        self.items.append(ev)
        if isinstance(ev, DoneEvent | ErrorEvent):
            self.done.set()

    def wait(self):
        assert self.done.wait(60), "no final event"
        return self.items[-1]


# Sampled at temperature 1 with a seed: a random tiny model's tokens then follow its logits closely, so equal
# tokens mean equal logits (greedy decoding of such a model repeats one token whatever the cache holds).
SAMPLING = dict(temperature=1.0, seed=7, ignore_eos=True)


def _run(backend, eng, blocks, mode="kv", tenant="acme", max_new=6, **kw):
    events = Events()
    req = GenRequest(ids=eng.question_ids("where did caroline move?"), blocks=list(blocks), mode=mode,
                     sampling=Sampling(max_new_tokens=max_new, **SAMPLING), emit=events, tenant=tenant, **kw)
    backend.submit(req)
    return req, events


def _tokens(events):
    return [e.token_id for e in events.items if isinstance(e, TokenEvent) and e.token_id is not None]


def _fills(tmp_path):
    trace = tmp_path / "trace"
    return trace.read_text().splitlines() if trace.exists() else []


def test_kv_answer_equals_the_pytorch_engines_and_the_connector_filled_the_pages(backend, eng, blocks, tmp_path):
    assert (len(eng.prefix_ids) + sum(b.num_tokens for b in blocks)) % TPB == 0
    _, events = _run(backend, eng, blocks)
    done = events.wait()
    assert isinstance(done, DoneEvent), done
    want = eng.ask(eng.question_ids("where did caroline move?"), list(blocks), "kv",
                   sampling=Sampling(max_new_tokens=6, **SAMPLING), keep_first_logits=True)
    # The forward pass over the pages the connector filled gives the PyTorch engine's kv-mode logits.
    got = backend.llm.first_logits[max(backend.llm.first_logits)]
    torch.testing.assert_close(got, want.first_logits, atol=2e-4, rtol=1e-4)
    assert _tokens(events) == want.token_ids
    assert done.memory_tokens == sum(b.num_tokens for b in blocks)
    assert done.prompt_tokens == want.prompt_tokens and done.completion_tokens == 6
    assert len(_fills(tmp_path)) == 1
    assert list(backend.registry.dir.iterdir()) == []  # the plan is withdrawn once the request is done
    assert backend.active == 0


def test_text_and_none_modes_send_no_plan(backend, eng, blocks, tmp_path):
    for mode in ("text", "none"):
        _, events = _run(backend, eng, blocks, mode=mode)
        assert isinstance(events.wait(), DoneEvent)
    assert _fills(tmp_path) == []


def test_kv_recompute_is_refused_before_any_work(backend, eng, blocks):
    with pytest.raises(InvalidInputError):
        _run(backend, eng, blocks, mode="kv-recompute")
    assert backend.active == 0


def test_another_tenant_sending_the_same_tokens_gets_no_pages(backend, eng, blocks, tmp_path):
    """acme's plan is held for its prompt; globex sends the very same token ids (text mode: no plan of its own).
    The connector refuses globex's salt: globex is prefilled, and no fill is traced for it."""
    req, events = _run(backend, eng, blocks, mode="kv", tenant="acme")
    prompt, entry = backend._layout(req)
    key = backend._hold(prompt, entry)  # keep acme's plan in place while globex asks
    events.wait()
    fills = len(_fills(tmp_path))
    _, other = _run(backend, eng, blocks, mode="text", tenant="globex")
    assert isinstance(other.wait(), DoneEvent)
    assert len(_fills(tmp_path)) == fills
    backend._release(GenRequest(ids=[1], blocks=[], mode="kv", sampling=Sampling(), emit=print, tenant="acme"), key)


def test_two_tenants_with_the_same_prompt_each_get_their_own_plan(backend, eng, blocks, tmp_path):
    """Same memories, same question, two tenants, at once: two plans (keyed by the salt id), two fills."""
    runs = [_run(backend, eng, blocks, tenant=t, max_new=20) for t in ("acme", "globex")]
    finals = [ev.wait() for _, ev in runs]
    assert all(isinstance(f, DoneEvent) for f in finals), finals
    assert len(_fills(tmp_path)) == 2, _fills(tmp_path)
    assert list(backend.registry.dir.iterdir()) == []


def test_a_vanished_plan_fails_that_request_and_the_engine_keeps_serving(backend, eng, blocks):
    scheduler = backend.llm.executor.scheduler
    build = scheduler.build_connector_meta

    def withdraw_then_build(output):
        for r in output.new_requests:
            backend.registry.discard(prompt_key(r.new_tokens, backend._salt_id(r.cache_salt)))
        return build(output)

    scheduler.build_connector_meta = withdraw_then_build
    _, events = _run(backend, eng, blocks)
    err = events.wait()
    assert isinstance(err, ErrorEvent) and isinstance(err.error, TransferError)
    scheduler.build_connector_meta = build
    _, events = _run(backend, eng, blocks)
    assert isinstance(events.wait(), DoneEvent)


def test_cancel_stops_the_request_and_releases_its_plan(backend, eng, blocks):
    req, events = _run(backend, eng, blocks, max_new=40)
    req.cancel()
    assert _until(lambda: backend.active == 0)
    assert not any(isinstance(e, DoneEvent) for e in events.items)
    assert list(backend.registry.dir.iterdir()) == []
    assert backend.llm.executor.scheduler.pending == {}


def test_encoding_memories_runs_on_the_project_model(backend, eng):
    import asyncio

    got = asyncio.run(backend.call(lambda e: e.encode([MemoryItem("c", "they went camping")])))
    assert got[0].item_id == "c" and got[0].kv.shape[3] == got[0].num_tokens


def test_without_tensorrt_llm_the_backend_refuses_to_start_naming_the_package(eng):
    from inferscale.trtllm.backend import require_tensorrt_llm

    code = "from inferscale.trtllm.backend import require_tensorrt_llm as r; r()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "ConfigError" in proc.stderr and "'tensorrt_llm'" in proc.stderr
    if importlib.util.find_spec("tensorrt_llm") is None:  # in process too, unless a session fixture holds the stand-in
        with pytest.raises(ConfigError, match="tensorrt_llm"):
            require_tensorrt_llm()



@contextlib.contextmanager
def gated_backend(eng, **options):
    """A backend over the stand-in with the given ``TrtllmOptions``; every request still running is cancelled at
    the end."""
    with trtllm_standin.installed() as trt:
        from inferscale.trtllm.backend import TrtllmBackend, TrtllmOptions

        trt.register_model("tiny", eng)
        backend = TrtllmBackend(eng, TrtllmOptions(model="tiny", tokens_per_block=TPB, **options))
        try:
            yield backend
        finally:
            for req in list(backend._inflight):
                req.cancel()
            _until(lambda: backend.active == 0)
            backend.close()
    os.environ.pop("INFERSCALE_TRTLLM_PLAN_DIR", None)


def _until(done, seconds: float = 30.0) -> bool:
    for _ in range(int(seconds / 0.05)):
        if done():
            return True
        threading.Event().wait(0.05)
    return done()


def _prompt_tokens(eng, blocks) -> int:
    return len(eng.prefix_ids) + sum(b.num_tokens for b in blocks) + len(eng.question_ids("where did caroline move?"))


def test_a_tenant_past_its_part_of_the_kv_waits_and_another_tenant_is_served(eng, blocks):
    """Attack: TensorRT-LLM's scheduler admits first come, first served, so a tenant filling its pool would hold up
    every other tenant's requests. Half the pool (``max_kv_tokens``) is held back for tenants with nothing in
    flight, each tenant may hold its part of the rest; past it a request waits in front of TensorRT-LLM (gate.py)
    and goes on once its tenant's own requests end."""
    need = _prompt_tokens(eng, blocks) + 200  # prompt + max_new
    with gated_backend(eng, max_kv_tokens=4 * need) as backend:
        running = [_run(backend, eng, blocks, max_new=200) for _ in range(2)]  # a lone tenant's part: 2 x need
        third, third_events = _run(backend, eng, blocks, max_new=4)
        other, other_events = _run(backend, eng, blocks, tenant="globex", max_new=4)  # its first: the reserve
        assert isinstance(other_events.wait(), DoneEvent)
        assert third_events.items == [] and backend.queued == 1  # still waiting for acme's part
        assert not any(e.done.is_set() for _, e in running)
        for req, _ in running:
            req.cancel()
        assert isinstance(third_events.wait(), DoneEvent)  # its tenant's part freed: it ran


def test_a_tenant_filling_the_batch_waits_past_its_part_and_another_tenants_first_request_runs_at_once(eng, blocks):
    """Attack: with TensorRT-LLM's batch full of tenant A's long answers (``max_batch_size`` 8), tenant B's request
    waited in its first-come-first-served queue until one of A's ended. Now an eighth of the slots is held back for
    tenants with nothing in flight: A's eighth request waits in front of TensorRT-LLM (not refused), B's first runs
    beside A's seven and ends before any of them."""
    with gated_backend(eng, max_batch_size=8) as backend:
        running = [_run(backend, eng, blocks, max_new=200) for _ in range(7)]
        eighth, eighth_events = _run(backend, eng, blocks, max_new=200)
        other, other_events = _run(backend, eng, blocks, tenant="globex", max_new=4)
        assert _until(other_events.done.is_set), "tenant B's request never ended"
        assert isinstance(other_events.items[-1], DoneEvent)
        assert not any(e.done.is_set() for _, e in running), "B waited for one of A's answers"
        assert eighth_events.items == [] and backend.queued == 1
        running[0][0].cancel()  # one of A's ends: its eighth takes the slot
        assert _until(lambda: any(isinstance(e, TokenEvent) for e in eighth_events.items))


def test_a_request_waiting_for_its_tenants_part_is_refused_at_the_queue_timeout_or_dropped_when_cancelled(eng, blocks):
    """A request that cannot get its tenant's part within the queue timeout hears 503's error (EngineBusyError with
    Retry-After), as the PyTorch engine's queue answers; one cancelled while it waits never reaches TensorRT-LLM and
    holds nothing after."""
    from inferscale.errors import EngineBusyError

    with gated_backend(eng, max_batch_size=8, queue_timeout_s=0.5) as backend:
        first = [_run(backend, eng, blocks, max_new=200) for _ in range(7)]  # a lone tenant's part: 7 of 8
        late, late_events = _run(backend, eng, blocks, max_new=4)
        final = late_events.wait()
        assert isinstance(final, ErrorEvent) and isinstance(final.error, EngineBusyError)
        assert final.error.retry_after_s >= 1 and "waited over 0.5 s" in str(final.error)
        gone, gone_events = _run(backend, eng, blocks, max_new=4)
        gone.cancel()
        assert _until(lambda: backend.queued == 0 and backend.active == 7)  # only the first seven still run
        assert gone_events.items == []
        assert not any(e.done.is_set() for _, e in first)
