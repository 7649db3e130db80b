"""A live server on loopback (uvicorn in a thread) over a tiny random-weight engine and the real offline embedder,
shared by the server tests; spans and metrics go to in-memory exporters."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for tiny_models
sys.path.append(str(Path(__file__).resolve().parents[2] / "e2e"))  # e2e_common (free ports) for the server tests

from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from inferscale.server.auth import hash_key  # noqa: E402

KEYS = {"acme": "isk-acme-key", "globex": "isk-globex-key", "tight": "isk-tight-key", "fuzz": "isk-fuzz-key",
        "small": "isk-small-key", "slow": "isk-slow-key", "nodisk": "isk-nodisk-key"}
# Per-tenant budgets under test (tests/security/test_abuse_tenants.py); DRAM share 32 MiB for "small".
BUDGETS = {"small": {"max_memories": 3, "dram_bytes": 32 << 20}, "slow": {"encode_tokens_per_minute": 150},
           "nodisk": {"max_disk_bytes": 1}}
MODEL = "gemma-3-270m"
METRICS_TOKEN = "metrics-secret"  # INFERSCALE_METRICS_TOKEN of the live server: the only key to /metrics


def bound_socket() -> socket.socket:
    """A loopback socket bound to a port of the OS's choosing, handed to uvicorn as it is: no other process, nor the
    next call, can take its port between choosing and binding (two ``free_port()`` calls once returned the same port
    and the second listener failed: 'address already in use', every server test an error)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


@pytest.fixture(scope="session")
def embedder():
    from inferscale.retrieval import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def tiny_engine():
    import tiny_models

    return tiny_models.engine("gemma3")


class Live:
    def __init__(self, app, url, spans, metrics, settings, internal_url=None):
        self.app, self.url, self.spans, self.metrics, self.settings = app, url, spans, metrics, settings
        self.internal_url = internal_url  # the internal listener (INFERSCALE_INTERNAL_PORT): /internal/v1/* only

    def client(self, tenant: str = "acme", **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=60, **kw)

    def headers(self, tenant: str = "acme") -> dict:
        return {"Authorization": f"Bearer {KEYS[tenant]}"}

    def scrape(self):
        """GET /metrics as Prometheus does: with the metrics token."""
        import httpx

        return httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=30)


def _serve(data, engine, embedder, engine_name: str = "pytorch"):
    """A live app (tenant and internal listeners) over ``engine``, served by the ``engine_name`` backend."""
    import uvicorn

    from inferscale.server.app import create_app
    from inferscale.store import KVStore
    from inferscale.server.settings import Settings

    tenants = data / "tenants.json"
    tenants.write_text(json.dumps({
        "acme": [hash_key(KEYS["acme"])],
        "globex": [hash_key(KEYS["globex"])],
        "fuzz": [hash_key(KEYS["fuzz"])],
        "tight": {"keys": [hash_key(KEYS["tight"])], "max_k": 3, "max_tokens": 8, "max_in_flight": 1},
        **{t: {"keys": [hash_key(KEYS[t])], **b} for t, b in BUDGETS.items()},
    }))
    settings = Settings(data_dir=data, tenants_file=tenants, model=MODEL, internal_token="internal-secret",
                        metrics_token=METRICS_TOKEN,
                        default_max_tokens=8, max_tokens=64, max_k=50, node_name="node-a", pod_name="pod-a",
                        kv_host_path=data / "kv", engine=engine_name, trtllm_tokens_per_block=8)
    spans, metrics = InMemorySpanExporter(), InMemoryMetricReader()
    store = KVStore(settings.store_dir, dram_budget_bytes=64 << 20, node="node-a", nixl=False)
    app = create_app(settings, engine=engine, embedder=embedder, store=store, span_exporter=spans,
                     metric_reader=metrics)
    sockets = [bound_socket(), bound_socket()]
    port, internal_port = (sock.getsockname()[1] for sock in sockets)
    servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")),
               uvicorn.Server(uvicorn.Config(app.state.internal_app, host="127.0.0.1", port=internal_port,
                                             log_level="warning", lifespan="off"))]
    threads = [threading.Thread(target=s.run, kwargs={"sockets": [sock]}, daemon=True)
               for s, sock in zip(servers, sockets)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while not all(s.started for s in servers):
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    yield Live(app, f"http://127.0.0.1:{port}", spans, metrics, settings, f"http://127.0.0.1:{internal_port}")
    for s in servers:
        s.should_exit = True
    for t in threads:
        t.join(10)
    for sock in sockets:
        sock.close()
    store.close()


@pytest.fixture(scope="session")
def live(tmp_path_factory, tiny_engine, embedder):
    yield from _serve(tmp_path_factory.mktemp("data"), tiny_engine, embedder)


@pytest.fixture(scope="session")
def live_trtllm(tmp_path_factory, embedder):
    """The same server with ``--engine trtllm``: TensorRT-LLM's stand-in (tests/trtllm/standin) runs the forward
    pass with a tiny model of its own, the InferScale connector filling the memory pages."""
    import tiny_models
    import trtllm_standin

    engine = tiny_models.engine("gemma3")
    with trtllm_standin.installed() as trt:
        trt.register_model(MODEL, engine)
        yield from _serve(tmp_path_factory.mktemp("data-trtllm"), engine, embedder, "trtllm")


@pytest.fixture(params=["pytorch", "trtllm"])
def engine_live(request):
    """The live server of each engine backend: a test using it runs once per engine."""
    return request.getfixturevalue("live" if request.param == "pytorch" else "live_trtllm")


@pytest.fixture
def engine_memories(engine_live):
    """User 'caroline' of tenant acme with five memories, on ``engine_live`` (uploaded once per server)."""
    if not getattr(engine_live, "sample_uploaded", False):
        _upload(engine_live)
        engine_live.sample_uploaded = True
    return SAMPLE


SAMPLE = [
    {"id": "m1", "text": "caroline went to a support group in may", "timestamp": "2023-05-08"},
    {"id": "m2", "text": "melanie painted the beach at sunset"},
    {"id": "m3", "text": "caroline moved to paris with her dog"},
    {"id": "m4", "text": "melanie went camping with her brother in june"},
    {"id": "m5", "text": "caroline reads a book about her sister"},
]


@pytest.fixture(scope="session")
def memories(live):
    """User 'caroline' of tenant acme with five memories."""
    return _upload(live)


def _upload(live):
    import httpx

    r = httpx.put(f"{live.url}/v1/memories/caroline", json={"items": SAMPLE}, headers=live.headers("acme"), timeout=60)
    assert r.status_code == 200, r.text
    return SAMPLE


@pytest.fixture
def acme_app(tmp_path, tiny_engine, embedder):
    """An app (not started) of the one tenant "acme" over the tiny engine, with its own store; a test starts it
    (``TestClient(app)``: the lifespan runs) as it needs."""
    from inferscale.server.app import create_app
    from inferscale.server.settings import Settings
    from inferscale.store import KVStore

    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"acme": [hash_key(KEYS["acme"])]}))
    settings = Settings(data_dir=tmp_path, tenants_file=tenants, model=MODEL)
    store = KVStore(settings.store_dir, dram_budget_bytes=16 << 20, nixl=False)
    try:
        yield create_app(settings, engine=tiny_engine, embedder=embedder, store=store)
    finally:
        store.close()
