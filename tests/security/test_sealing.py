"""Blobs at rest are sealed per tenant (AES-GCM, bound to tenant/user/item): a forged, tampered or moved blob is
refused with a typed error and never served; no memory text or KV bytes lie in plain form under the data dir.

Every attack here goes through the store the server opens (``open_store``) and the files an attacker with write
access to the disk tier or a Job's output dir could plant."""

from __future__ import annotations

import shutil
import stat

import pytest
import torch

from inferscale.errors import BlobCorruptError, NotFoundError
from inferscale.kvformat import SUFFIX, encode_blob

from .conftest import FP, make_block


def _refused(store, tenant, user, item):
    """get_many of a planted blob from disk: must raise the typed error, never return the block."""
    with pytest.raises(BlobCorruptError) as e:
        store.get_many(tenant, user, [item], FP, copy=True)
    assert item in str(e.value)


def _path(store, tenant, user, item):
    return next(i.path for i in store.list(tenant, user) if i.item_id == item)


# Each forgery keeps the blob's size, so only authentication can tell it from the original.
@pytest.mark.parametrize("change", [{"text": "forged memory m1"}, {"start_pos": 0}, {"tokens": [41, 42, 43, 44]}])
def test_forged_blob_with_valid_sha256_is_refused_on_load(server_store, change):
    s = server_store()
    s.put("acme", "alice", make_block("m1"), cache=False)
    path = _path(s, "acme", "alice", "m1")
    s.close()
    # Same tensors (so the unkeyed sha256 matches the catalogue), forged metadata.
    forged = make_block("m1", text=change.get("text"), start_pos=change.get("start_pos", 7))
    if "tokens" in change:
        forged.token_ids = change["tokens"]
    open(path, "wb").write(encode_blob(forged))
    _refused(server_store(), "acme", "alice", "m1")


@pytest.mark.parametrize("dest", [("globex", "bob"), ("acme", "bob")])
def test_blob_moved_to_another_tenant_or_user_is_refused(server_store, dest):
    s = server_store()
    s.put("acme", "alice", make_block("m1", text="alice's secret"), cache=False)
    s.put(*dest, make_block("m1", text="bob's   secret"), cache=False)  # same tensors and size: same sha256
    shutil.copyfile(_path(s, "acme", "alice", "m1"), _path(s, *dest, "m1"))
    s.close()
    s = server_store()
    _refused(s, *dest, "m1")
    got, _ = s.get_many("acme", "alice", ["m1"], FP)  # the original still opens where it belongs
    assert got[0].text == "alice's secret"


@pytest.mark.parametrize("dest", [("globex", "bob"), ("acme", "bob")])
def test_job_dir_import_refuses_a_blob_of_another_tenant_or_user(server_store, tmp_path, dest):
    s = server_store()
    s.put("acme", "alice", make_block("m1"), cache=False)
    job = tmp_path / "kv" / dest[0] / dest[1]
    job.mkdir(parents=True)
    shutil.copyfile(_path(s, "acme", "alice", "m1"), job / f"m1{SUFFIX}")
    with pytest.raises(BlobCorruptError) as e:
        s.import_dir(*dest, job)
    assert type(e.value).__name__ == "BlobAuthError"
    with pytest.raises(NotFoundError):  # nothing of the refused import was stored
        s.list(*dest)


def test_job_dir_import_refuses_a_forged_plain_blob(server_store, tmp_path):
    s = server_store()
    job = tmp_path / "kv" / "acme" / "alice"
    job.mkdir(parents=True)
    (job / f"m1{SUFFIX}").write_bytes(encode_blob(make_block("m1", text="planted")))  # valid unkeyed sha256
    with pytest.raises(BlobCorruptError) as e:
        s.import_dir("acme", "alice", job)
    assert type(e.value).__name__ == "BlobAuthError" and "m1" in str(e.value)


def test_rebuild_skips_an_unauthenticated_blob(server_store, tmp_path):
    s = server_store()
    s.put("acme", "alice", make_block("m1"), cache=False)
    good = _path(s, "acme", "alice", "m1")
    s.close()
    planted = good.replace("/acme/alice/", "/acme/mallory/")
    from pathlib import Path

    Path(planted).parent.mkdir(parents=True)
    Path(planted).write_bytes(encode_blob(make_block("m1", text="planted")))
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / "data" / "store" / f"catalogue.sqlite{suffix}").unlink(missing_ok=True)
    s = server_store()
    assert s.users("acme") == ["alice"]  # the planted blob was not trusted
    assert [i.item_id for i in s.list("acme", "alice")] == ["m1"]


def test_orphan_temp_files_are_removed_at_start(server_store):
    s = server_store()
    s.put("acme", "alice", make_block("m1"), cache=False)
    from pathlib import Path

    d = Path(_path(s, "acme", "alice", "m1")).parent
    s.close()
    orphan = d / f".m1{SUFFIX}.x1y2z3.tmp"
    orphan.write_bytes(b"a crash cut this write short")
    server_store()
    assert not orphan.exists() and (d / f"m1{SUFFIX}").exists()


def test_blob_files_are_private(server_store):
    s = server_store()
    s.put("acme", "alice", make_block("m1"), cache=False)
    assert stat.S_IMODE(__import__("os").stat(_path(s, "acme", "alice", "m1")).st_mode) == 0o600


def test_no_memory_text_or_kv_bytes_in_plain_form_under_the_data_dir(live_server):
    """PUT memories through the real server (the store it opens itself), then grep every file under the data
    dir (store, catalogue and its WAL, temp files) for each memory's text and for windows of its raw K/V bytes."""
    import httpx

    url, app, data_dir, key = live_server
    items = [{"id": f"m{i}", "text": f"confidential memory number {i}: the vault code is {1000 + 37 * i}"}
             for i in range(4)]
    r = httpx.put(f"{url}/v1/memories/carol", json={"items": items}, headers={"Authorization": f"Bearer {key}"},
                  timeout=120)
    assert r.status_code == 200, r.text
    store = app.state.store
    infos = store.list("acme", "carol")
    assert len(infos) == 4
    blocks, _ = store.get_many("acme", "carol", [i.item_id for i in infos], infos[0].fingerprint, copy=True)
    needles = []
    for b in blocks:
        needles.append(b.text.encode())
        raw = b.kv.contiguous().view(torch.uint8).flatten().numpy().tobytes()
        half = b.kv[0, 0].contiguous().view(torch.uint8).flatten().numpy().tobytes()  # layer 0 K
        needles += [raw[len(raw) // 2 : len(raw) // 2 + 64], half[:64], raw[-64:]]
    files = [p for p in data_dir.rglob("*") if p.is_file()]
    assert any(p.name.endswith(SUFFIX) for p in files)
    for p in files:
        content = p.read_bytes()
        for n in needles:
            assert n not in content, f"{p} holds plain memory data"


@pytest.fixture
def live_server(tmp_path):
    """A server over loopback that opens its own store from settings (KEK created in the data dir)."""
    import json
    import socket
    import threading
    import time

    import tiny_models
    import uvicorn

    from inferscale.retrieval import Embedder
    from inferscale.server.app import create_app
    from inferscale.server.auth import hash_key
    from inferscale.server.settings import Settings

    data = tmp_path / "data"
    data.mkdir()
    (data / "tenants.json").write_text(json.dumps({"acme": [hash_key("isk-acme")]}))
    settings = Settings(data_dir=data, dram_budget_bytes=64 << 20, model="gemma-3-270m")
    app = create_app(settings, engine=tiny_models.engine("gemma3"), embedder=Embedder())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", app, data, "isk-acme"
    server.should_exit = True
    thread.join(10)
