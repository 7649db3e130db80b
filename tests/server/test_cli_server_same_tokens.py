"""``inferscale ask`` (the CLI; ``bench ttft``/``bench locomo`` call the same ``Engine.ask``) and the server, each
loading the same model directory, give the same answer to the same request: one serving loop."""

from __future__ import annotations

import json
import threading
import time

import pytest

import tiny_models as tm
from e2e_common import free_port
from inferscale.cli import main
from inferscale.server.auth import hash_key

ITEMS = [{"id": "a", "text": "caroline went to paris with her dog"},
         {"id": "b", "text": "melanie painted the beach in june", "timestamp": "june 2023"}]
QUESTION = "where did caroline go?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-gemma3-same")
    tm.model("gemma3", sliding_window=8).save_pretrained(d)
    tm.tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, embedder):
    import uvicorn

    from inferscale.server.app import create_app
    from inferscale.server.settings import Settings
    from inferscale.store import KVStore

    data = tmp_path_factory.mktemp("same-data")
    (data / "tenants.json").write_text(json.dumps({"acme": [hash_key("isk-same")]}))
    settings = Settings(data_dir=data, tenants_file=data / "tenants.json", model=str(model_dir), node_name="n")
    store = KVStore(settings.store_dir, dram_budget_bytes=64 << 20, node="n", nixl=False)
    app = create_app(settings, embedder=embedder, store=store)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    import httpx

    url = f"http://127.0.0.1:{port}"
    r = httpx.put(f"{url}/v1/memories/caroline", json={"items": ITEMS},
                  headers={"Authorization": "Bearer isk-same"}, timeout=60)
    assert r.status_code == 200, r.text
    yield url
    srv.should_exit = True
    thread.join(10)
    store.close()


@pytest.mark.parametrize("mode", ["kv", "text", "none"])
def test_cli_and_server_give_the_same_answer(model_dir, server, tmp_path, capsys, mode):
    from openai import OpenAI

    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    blobs = tmp_path / "blobs"
    assert main(["encode", str(jsonl), "--out", str(blobs), "--model", str(model_dir)]) == 0
    capsys.readouterr()
    assert main(["ask", QUESTION, "--blobs", str(blobs), "--model", str(model_dir), "--mode", mode, "--json",
                 "--max-tokens", "6"]) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    client = OpenAI(base_url=server + "/v1", api_key="isk-same", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=str(model_dir), user="caroline", max_tokens=6,
                                       messages=[{"role": "user", "content": QUESTION}],
                                       extra_body={"inferscale": {"k": 2, "mode": mode}})
    assert r.model_extra["inferscale"]["items"] == (["a", "b"] if mode != "none" else [])
    assert r.choices[0].message.content == cli["answer"]
    assert cli["answer"], "an empty answer would match trivially"
