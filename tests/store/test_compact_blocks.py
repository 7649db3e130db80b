"""Compact blocks (inferscale.kvquant) are stored, sealed, accounted and moved compact by every tier."""

import pytest
import torch

from inferscale import sealing
from inferscale.kvformat import compact, save_block
from inferscale.store import KVStore
from inferscale.bench.node import child_process, serve_node

from .helpers import FP, PEER_SECRET, PEER_TLS, make_block

FORMATS = ("int8", "fp8", "int4")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # fp8 has no equal


@pytest.mark.parametrize("fmt", FORMATS)
def test_store_accounts_and_serves_the_compact_image(open_store, fmt):
    s = open_store()
    plain, packed = make_block("m0", tokens=8), compact(make_block("m0", tokens=8), fmt)
    s.put("acme", "alice", plain)
    s.put("acme", "bob", packed)
    (p_info,), (c_info,) = s.list("acme", "alice"), s.list("acme", "bob")
    # the catalogue's KV size is the compact tensor plus its scales; the blob (what tiers move) shrinks with it
    assert c_info.kv_bytes == packed.nbytes < 0.3 * p_info.kv_bytes  # fp32 helper blocks: int8 is ~1/4
    assert c_info.size < 0.4 * p_info.size
    for cold in (False, True):
        if cold:
            s.dram.drop(lambda k: True)
        got, st = s.get_many("acme", "bob", ["m0"], FP)
        assert st.bytes == packed.nbytes and st.served["m0"] == ("disk" if cold else "dram")
        b = got[0]
        assert b.kv_dtype == fmt and _same(b.kv, packed.kv) and torch.equal(b.kv_scale, packed.kv_scale)
        assert torch.equal(b.float_kv(), packed.float_kv())
    owned, _ = s.get_many("acme", "bob", ["m0"], FP, copy=True)
    assert owned[0].kv_scale is not None and owned[0].kv_scale.is_contiguous()


def test_sealed_store_and_job_dir_import_keep_the_format(open_store, tmp_path):
    keyring = sealing.Keyring.from_text(sealing.new_key_line())
    s = open_store(keyring=keyring)
    job = tmp_path / "job"
    blocks = [compact(make_block(f"m{i}"), f) for i, f in enumerate(FORMATS)]
    for b in blocks:
        save_block(b, job, keyring=keyring, tenant="acme", user="alice")  # as an encode Job writes them
    s.import_dir("acme", "alice", job)
    s.dram.drop(lambda k: True)
    got, _ = s.get_many("acme", "alice", [b.item_id for b in blocks], FP)
    for g, b in zip(got, blocks):
        assert g.kv_dtype == b.kv_dtype and _same(g.kv, b.kv) and torch.equal(g.kv_scale, b.kv_scale)
    s.close()
    reopened = KVStore(tmp_path / "kv", dram_budget_bytes=8 << 20, keyring=keyring, nixl=False)  # rebuild reads them
    try:
        assert {i.item_id: i.kv_bytes for i in reopened.list("acme", "alice")} == {b.item_id: b.nbytes for b in blocks}
    finally:
        reopened.close()


@pytest.fixture
def compact_peer(tmp_path):
    root = tmp_path / "peer"
    with KVStore(root, dram_budget_bytes=8 << 20, nixl=False) as s:
        for i, f in enumerate(FORMATS):
            s.put("acme", "alice", compact(make_block(f"m{i}", tokens=5), f))
    options = {"dram_budget_bytes": 8 << 20, "timeout_s": 10.0, "peer_secret": PEER_SECRET, "peer_tls": PEER_TLS, "preload": [("acme", "alice", FP)]}
    with child_process(serve_node, str(root), options) as info:
        yield info["peer"]


def test_peer_pull_moves_compact_images(open_store, compact_peer):
    s = open_store(timeout_s=10.0)
    want = [compact(make_block(f"m{i}", tokens=5), f) for i, f in enumerate(FORMATS)]
    r = s.pull_from_peer("acme", "alice", compact_peer)
    assert r.blocks == 3
    # the bytes moved are the compact images: well under the float blocks they came from
    assert r.bytes < 0.4 * sum(make_block(f"m{i}", tokens=5).nbytes for i in range(3))
    got, _ = s.get_many("acme", "alice", [b.item_id for b in want], FP)
    for g, b in zip(got, want):
        assert g.kv_dtype == b.kv_dtype and _same(g.kv, b.kv) and torch.equal(g.kv_scale, b.kv_scale)
