"""The connector driven through TensorRT-LLM's call sequence on CPU (the stand-in executor,
tests/trtllm/standin/tensorrt_llm/_executor.py): admit -> match -> allocate -> load -> finish, with a plan that
vanished, a salt that does not match, pages partly held, and a request aborted before its forward pass."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tm
import trtllm_standin
from inferscale.engine import MemoryItem
from inferscale.engine.cache import injected_cache, kv_of_cache
from inferscale.trtllm import InjectionEntry, PlanRegistry, cache_salt, plan_span, prompt_key

TPB = 4
SECRET = b"k" * 32


@pytest.fixture(scope="module")
def setup():
    eng = tm.engine("llama")
    blocks = eng.encode([MemoryItem("a", "caroline moved to paris with her dog"),
                         MemoryItem("b", "melanie painted the beach at sunset")])
    question = eng.question_ids("where did caroline move?")
    prompt = list(eng.prefix_ids) + [t for b in blocks for t in b.token_ids] + list(question)
    # What the PyTorch engine injects for this prompt: the reference for the pages the connector fills.
    want = kv_of_cache(injected_cache(eng.prefix_kv, blocks, eng.loaded.layout, eng.loaded.model.config,
                                      windowed=False))
    return eng, blocks, question, prompt, want


@pytest.fixture
def trt(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERSCALE_TRTLLM_PLAN_DIR", str(tmp_path))
    with trtllm_standin.installed() as trt:
        yield trt


def _executor(eng):
    from tensorrt_llm._executor import PagedPool, StandinExecutor
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig, TorchLlmArgs

    from inferscale.trtllm.connector import InferScaleConnectorScheduler, InferScaleConnectorWorker

    args = TorchLlmArgs(model="tiny", kv_cache_config=KvCacheConfig(tokens_per_block=TPB))
    kv = eng.prefix_kv
    pool = PagedPool(64, kv.shape[0], kv.shape[2], TPB, kv.shape[4], torch.float32, kv.device)
    pool.pages.fill_(float("nan"))  # whatever a page held before: a claim must overwrite every value it covers
    return StandinExecutor(InferScaleConnectorScheduler(args), InferScaleConnectorWorker(args), pool, kv.shape[0])


def _plan(eng, blocks, prompt, tenant="acme"):
    groups = [(list(layers), f) for layers, f in eng.loaded.layout.freq_groups().values()]
    entry = InjectionEntry(eng.prefix_kv, [b.float_kv() for b in blocks], [b.start_pos for b in blocks], groups,
                           cache_salt(SECRET, tenant))
    import os

    from tensorrt_llm.inputs.utils import get_cache_salt_id

    PlanRegistry(os.environ["INFERSCALE_TRTLLM_PLAN_DIR"]).put(prompt, entry, get_cache_salt_id(entry.salt))
    return entry


def _key(prompt, tenant="acme"):
    """The plan's key: the tokens and the id of the tenant's salt (as the connector looks it up)."""
    from tensorrt_llm.inputs.utils import get_cache_salt_id

    return prompt_key(prompt, get_cache_salt_id(cache_salt(SECRET, tenant)))


def _request(rid, prompt, tenant="acme", salt=None):
    from tensorrt_llm._executor import StandinRequest
    from tensorrt_llm.inputs.utils import get_cache_salt_id

    salt = salt if salt is not None else cache_salt(SECRET, tenant)
    return StandinRequest(rid, list(prompt), salt, get_cache_salt_id(salt))


def _claim(eng, blocks, question):
    return plan_span(len(eng.prefix_ids), [(b.num_tokens, b.start_pos) for b in blocks], len(question), TPB).claim_end


def test_admit_match_allocate_load_fills_the_claimed_pages_with_the_injected_kv(setup, trt):
    eng, blocks, question, prompt, want = setup
    ex = _executor(eng)
    _plan(eng, blocks, prompt)
    req = _request(1, prompt)
    ex.admit(req)
    claim = _claim(eng, blocks, question)
    assert (req.held, req.matched) == (0, claim) and claim > 0
    got = ex.pool.read(req.pages, claim)
    torch.testing.assert_close(got, want[:, :, :, :claim].float(), atol=1e-5, rtol=1e-5)
    assert not torch.isnan(ex.pool.read(req.pages, claim)).any()
    ex.finish(req)
    assert ex.scheduler.pending == {}


def test_a_plan_that_vanished_before_the_load_zeroes_the_pages_and_fails_only_that_request(setup, trt):
    eng, blocks, question, prompt, _ = setup
    ex = _executor(eng)
    _plan(eng, blocks, prompt)
    build = ex.scheduler.build_connector_meta

    def withdraw_then_build(output):  # the server withdrew the plan between the match and the load
        ex.worker.registry.discard(_key(prompt))
        return build(output)

    ex.scheduler.build_connector_meta = withdraw_then_build
    req = _request(1, prompt)
    ex.admit(req)  # no exception: the executor keeps serving everyone else
    claim = _claim(eng, blocks, question)
    assert torch.equal(ex.pool.read(req.pages, claim), torch.zeros_like(ex.pool.read(req.pages, claim)))
    assert ex.worker.registry.failure(_key(prompt)) == "vanished"


def test_another_tenants_salt_gets_no_pages(setup, trt):
    eng, blocks, _, prompt, _ = setup
    ex = _executor(eng)
    _plan(eng, blocks, prompt, tenant="acme")
    req = _request(1, prompt, tenant="globex")  # the very same token ids, another tenant
    ex.admit(req)
    assert req.matched == 0
    assert torch.isnan(ex.pool.read(req.pages, len(prompt))).all()  # untouched: TensorRT-LLM prefills them
    assert ex.worker.registry.failure(_key(prompt)) is None
    assert _key(prompt, "globex") != _key(prompt)  # the salt id is part of the plan's identifier


def test_a_plan_keyed_under_another_salt_id_is_still_refused_by_its_salt(setup, trt):
    """A plan file reachable under a request's key but carrying another tenant's salt gives no pages."""
    import os

    from tensorrt_llm.inputs.utils import get_cache_salt_id

    eng, blocks, _, prompt, _ = setup
    ex = _executor(eng)
    entry = _plan(eng, blocks, prompt, tenant="acme")
    PlanRegistry(os.environ["INFERSCALE_TRTLLM_PLAN_DIR"]).put(prompt, entry,
                                                                get_cache_salt_id(cache_salt(SECRET, "globex")))
    req = _request(1, prompt, tenant="globex")
    ex.admit(req)
    assert req.matched == 0


def test_a_salt_string_that_differs_at_scheduling_is_refused_and_zeroed(setup, trt):
    """The 64-bit id matched (a collision, or a forged id) but ``RequestData.cache_salt`` is not the plan's."""
    eng, blocks, question, prompt, _ = setup
    ex = _executor(eng)
    _plan(eng, blocks, prompt, tenant="acme")
    req = _request(1, prompt, tenant="acme")
    req.cache_salt = cache_salt(SECRET, "globex")
    ex.admit(req)
    claim = _claim(eng, blocks, question)
    assert req.matched == claim
    assert torch.equal(ex.pool.read(req.pages, claim), torch.zeros_like(ex.pool.read(req.pages, claim)))
    assert ex.worker.registry.failure(_key(prompt)) == "salt"


def test_pages_partly_held_are_kept_and_the_connector_fills_from_there(setup, trt):
    eng, blocks, question, prompt, want = setup
    ex = _executor(eng)
    _plan(eng, blocks, prompt)
    first = _request(1, prompt)
    ex.admit(first)
    ex.finish(first)  # its full prompt pages stay held under acme's salt
    # Same prefix, other memories: TensorRT-LLM holds the prefix's whole pages, the connector fills the rest.
    other = blocks[1:]
    prompt2 = list(eng.prefix_ids) + [t for b in other for t in b.token_ids] + list(question)
    _plan(eng, other, prompt2)
    second = _request(2, prompt2)
    ex.admit(second)
    held = len(eng.prefix_ids) // TPB * TPB
    assert second.held == held > 0
    assert second.pages[: held // TPB] == first.pages[: held // TPB]
    claim = _claim(eng, other, question)
    assert second.matched == claim - held
    want2 = kv_of_cache(injected_cache(eng.prefix_kv, other, eng.loaded.layout, eng.loaded.model.config,
                                       windowed=False))
    torch.testing.assert_close(ex.pool.read(second.pages, claim), want2[:, :, :, :claim].float(), atol=1e-5,
                               rtol=1e-5)
    # The same prompt again is held whole: nothing left for the connector to claim.
    third = _request(3, prompt)
    ex.admit(third)
    assert third.held >= claim and third.matched == 0


def test_a_request_aborted_before_its_forward_pass_releases_everything(setup, trt):
    eng, blocks, _, prompt, _ = setup
    ex = _executor(eng)
    _plan(eng, blocks, prompt)
    free = len(ex.pool.free)
    req = _request(1, prompt)
    n, _ = ex.scheduler.get_num_new_matched_tokens(req, 0)
    assert n > 0 and req.request_id in ex.scheduler.pending
    ex.finish(req)  # aborted between the match and its allocation
    assert ex.scheduler.pending == {} and len(ex.pool.free) == free
