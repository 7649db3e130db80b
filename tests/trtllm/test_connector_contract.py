"""The connector against the TensorRT-LLM API it claims, as data read from TensorRT-LLM's public source.

One row per release we support; ``PINNED`` is the one the connector is written for. Each row holds where the
connector ABCs live, their constructors and every abstract method with its parameters (names, in order, from the
``def`` lines of that file), the ``RequestData`` fields, and what else the connector imports. The test checks our
classes against the rows with ``inspect.signature`` (and the TensorRT-LLM stand-in against them too), so a renamed
method, a changed parameter or a missing abstract method fails here, without TensorRT-LLM installed.

Sources (NVIDIA/TensorRT-LLM on GitHub, read with the repository index; nothing copied):
- PINNED: ``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` at commit
  035ab91cad04b7b77a479a9526edecfbc742c661 (``KvCacheConnectorWorker`` / ``KvCacheConnectorScheduler`` ABCs,
  ``RequestData`` with ``cache_salt``, ``SchedulerOutput`` with ``attention_dp_rank``), the API the 1.4.0rc4 docs
  describe (features/kv-cache-connector.html: attention-DP schedulers). No ``shutdown``, ``abort_request`` or
  ``finalize_finished_loads`` is abstract there (``wait_for_initialization`` and the per-layer-group forms have
  defaults), so the connector implements none of them.
- EARLIER: ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py`` at commit
  00fdcbff5ad82a6438b3e0c9dbc5480b6ee52bdc, the layout of 1.2.0rc0 (its docs example imports the ABCs from this
  path and builds them with ``llm_args: TorchLlmArgs``); ``RequestData`` has no ``cache_salt`` yet.
- Both: ``tensorrt_llm/llmapi/llm_args.py`` ``KvCacheConnectorConfig(connector_module, connector_scheduler_class,
  connector_worker_class)``; ``tensorrt_llm/inputs/utils.py`` ``get_cache_salt_id(cache_salt: str) -> int``.
"""

from __future__ import annotations

import inspect

import pytest

import trtllm_standin

WORKER_ABSTRACT = {
    "register_kv_caches": ("self", "kv_cache_tensor"),
    "start_load_kv": ("self", "stream"),
    "wait_for_layer_load": ("self", "layer_idx", "stream"),
    "save_kv_layer": ("self", "layer_idx", "stream"),
    "wait_for_save": ("self", "stream"),
    "get_finished": ("self", "finished_gen_req_ids", "started_loading_req_ids"),
}
SCHEDULER_ABSTRACT = {
    "build_connector_meta": ("self", "scheduler_output"),
    "get_num_new_matched_tokens": ("self", "request", "num_computed_tokens"),
    "request_finished": ("self", "request", "cache_block_ids"),
    "update_state_after_alloc": ("self", "request", "block_ids"),
}
REQUEST_DATA = ("request_id", "new_tokens", "new_block_ids", "computed_position", "num_scheduled_tokens")

PINNED = {
    "release": "1.4.0rc4",
    "commit": "035ab91cad04b7b77a479a9526edecfbc742c661",
    "file": "tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py",
    "module": "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
    "init": ("self", "llm_args"),
    "worker": WORKER_ABSTRACT,
    "scheduler": SCHEDULER_ABSTRACT,
    "request_data": REQUEST_DATA + ("block_hashes", "priorities", "cache_salt", "new_block_ids_by_layer_group"),
    "salt_id": ("tensorrt_llm.inputs.utils", "get_cache_salt_id"),
    "connector_config": ("connector_module", "connector_scheduler_class", "connector_worker_class"),
}
EARLIER = {  # same constructor, abstract methods, salt id and config fields as PINNED; elsewhere, no salt field
    **PINNED,
    "release": "1.2.0rc0",
    "commit": "00fdcbff5ad82a6438b3e0c9dbc5480b6ee52bdc",
    "file": "tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py",
    "module": "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
    "request_data": REQUEST_DATA,
}
RELEASES = [PINNED, EARLIER]


def params(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def contract_violations(worker_cls, scheduler_cls, row) -> list[str]:
    """What in our classes differs from ``row``: a missing or still-abstract method, other parameters."""
    found = []
    for cls, side in ((worker_cls, "worker"), (scheduler_cls, "scheduler")):
        if params(cls.__init__) != row["init"]:
            found.append(f"{cls.__name__}.__init__{params(cls.__init__)} != {row['init']}")
        for name, want in row[side].items():
            fn = cls.__dict__.get(name)
            if fn is None or getattr(fn, "__isabstractmethod__", False):
                found.append(f"{cls.__name__}.{name} is not implemented")
            elif params(fn) != want:
                found.append(f"{cls.__name__}.{name}{params(fn)} != {want} ({row['release']})")
    return found


@pytest.fixture
def connector(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSCALE_TRTLLM_PLAN_DIR", str(tmp_path))
    with trtllm_standin.installed():
        import inferscale.trtllm.connector as connector

        yield connector


@pytest.mark.parametrize("row", RELEASES, ids=[r["release"] for r in RELEASES])
def test_connector_implements_every_abstract_method_with_the_releases_signature(connector, row):
    assert contract_violations(connector.InferScaleConnectorWorker, connector.InferScaleConnectorScheduler,
                               row) == []


@pytest.mark.parametrize("row", RELEASES, ids=[r["release"] for r in RELEASES])
def test_connector_looks_for_the_releases_module_and_salt_id(connector, row):
    assert row["module"] in connector.ABC_MODULES
    assert row["module"].replace(".", "/") + ".py" == row["file"]
    assert (connector.SALT_ID_MODULE, "get_cache_salt_id") == row["salt_id"]


def test_the_pinned_release_comes_first_and_its_salt_field_is_read(connector):
    """The connector binds the pinned release's ABCs when both exist, and checks ``RequestData.cache_salt``
    (the field the pinned release added for connectors that key on tokens)."""
    assert connector.ABC_MODULES[0] == PINNED["module"]
    assert "cache_salt" in PINNED["request_data"] and "cache_salt" not in EARLIER["request_data"]
    src = inspect.getsource(connector.InferScaleConnectorScheduler.build_connector_meta)
    assert '"cache_salt"' in src


def test_backend_configures_the_connector_with_the_releases_fields():
    from inferscale.trtllm.backend import CONNECTOR

    assert tuple(CONNECTOR) == PINNED["connector_config"]
    assert CONNECTOR["connector_module"] == "inferscale.trtllm.connector"


def test_the_standin_matches_the_pinned_release(connector):
    """The stand-in the CPU tests run on has the pinned API, so a test that passes on it tests that API."""
    import dataclasses
    import importlib

    from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig

    abcs = importlib.import_module(PINNED["module"])
    assert abcs.KvCacheConnectorWorker.__abstractmethods__ == set(PINNED["worker"])
    assert abcs.KvCacheConnectorScheduler.__abstractmethods__ == set(PINNED["scheduler"])
    for cls, side in ((abcs.KvCacheConnectorWorker, "worker"), (abcs.KvCacheConnectorScheduler, "scheduler")):
        assert params(cls.__init__) == PINNED["init"]
        assert {n: params(getattr(cls, n)) for n in PINNED[side]} == PINNED[side]
    assert tuple(f.name for f in dataclasses.fields(abcs.RequestData)) == PINNED["request_data"]
    assert tuple(f.name for f in dataclasses.fields(KvCacheConnectorConfig)) == PINNED["connector_config"]


@pytest.mark.parametrize("change", ["rename_param", "drop_method", "extra_param", "rename_method"])
def test_a_changed_method_or_signature_fails_the_contract(connector, change):
    """The check is not vacuous: each kind of drift from the pinned API is reported."""
    worker, scheduler = connector.InferScaleConnectorWorker, connector.InferScaleConnectorScheduler
    if change == "rename_param":
        class Drifted(scheduler):
            def get_num_new_matched_tokens(self, req, num_computed_tokens):
                return 0, False
        scheduler = Drifted
    elif change == "extra_param":
        class Drifted(worker):
            def start_load_kv(self, stream, metadata=None):
                pass
        worker = Drifted
    elif change == "drop_method":
        worker = type("Drifted", (connector.KvCacheConnectorWorker,),
                      {k: v for k, v in worker.__dict__.items() if k != "wait_for_save"})
    else:
        row = dict(PINNED, scheduler={**{k: v for k, v in SCHEDULER_ABSTRACT.items() if k != "request_finished"},
                                      "request_finished_v2": ("self", "request", "cache_block_ids")})
        assert contract_violations(worker, scheduler, row)
        return
    assert contract_violations(worker, scheduler, PINNED)


def test_an_installed_tensorrt_llm_matches_a_supported_release():
    """Where TensorRT-LLM really is installed (scripts/gpu-check.sh): its connector API is one of the rows."""
    import importlib
    import importlib.util
    import sys

    if "tensorrt_llm" in sys.modules or importlib.util.find_spec("tensorrt_llm") is None:
        pytest.skip("TensorRT-LLM is not installed here (the stand-in covers the CPU tests)")
    for row in RELEASES:
        try:
            abcs = importlib.import_module(row["module"])
        except ModuleNotFoundError:
            continue
        worker, scheduler = abcs.KvCacheConnectorWorker, abcs.KvCacheConnectorScheduler
        assert {n: params(getattr(worker, n)) for n in row["worker"]} == row["worker"]
        assert {n: params(getattr(scheduler, n)) for n in row["scheduler"]} == row["scheduler"]
        assert worker.__abstractmethods__ <= set(row["worker"]) | {"register_kv_caches"}
        assert scheduler.__abstractmethods__ <= set(row["scheduler"])
        return
    pytest.fail(f"the installed TensorRT-LLM has none of {[r['module'] for r in RELEASES]}")
