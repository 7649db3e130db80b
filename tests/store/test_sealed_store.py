"""A store with a KEK: blobs sealed on disk, opened on their way up, plain in DRAM; rotation, Job-dir imports
from ``inferscale encode --kek-file``, peer pulls sealed under the puller's key."""

from __future__ import annotations

import base64
import os

import pytest
import torch

from inferscale import sealing
from inferscale.errors import BlobAuthError, BlobCorruptError, ConfigError
from inferscale.kvformat import SUFFIX, encode_blob, load_block, save_block
from inferscale.bench.node import child_process, serve_node
from inferscale.store import KVStore

from .helpers import FP, PEER_SECRET, PEER_TLS, make_block


def _write_kek(path, text):
    path.write_text(text)
    path.chmod(0o600)  # a KEK file others can read is refused


def _kek(path, *kids):
    _write_kek(path, "".join(sealing.new_key_line(k) for k in kids))
    return sealing.Keyring.load(path)


@pytest.fixture
def keyring(tmp_path):
    return _kek(tmp_path / "kek", "k1")


def test_sealed_round_trip_through_disk(open_store, keyring):
    s = open_store(keyring=keyring)
    for i in range(3):
        s.put("acme", "alice", make_block(f"m{i}", tokens=4 + i))
    path = s.list("acme", "alice")[0].path
    raw = open(path, "rb").read()
    assert sealing.is_sealed(raw) and b"m0 v0" not in raw
    s.dram.drop(lambda k: True)
    got, st = s.get_many("acme", "alice", ["m0", "m1", "m2"], FP)
    assert st.tiers["disk"] == 3
    for i, b in enumerate(got):
        want = make_block(f"m{i}", tokens=4 + i)
        assert torch.equal(b.kv, want.kv) and torch.equal(b.embedding, want.embedding)
        assert (b.text, b.token_ids, b.start_pos, b.timestamp) == (want.text, want.token_ids, 7, "2023-05-08")
    # the slots were shrunk to the plain images: the tenant holds exactly what it would unsealed
    assert s.dram.tenant_bytes("acme") == sum(-(-i.size // 64) * 64 for i in s.list("acme", "alice"))
    ids, emb = s.embeddings("acme", "alice", FP)
    assert ids == ["m0", "m1", "m2"] and emb.shape == (3, 16)


def test_tampered_ciphertext_or_header_is_refused(open_store, keyring):
    s = open_store(keyring=keyring)
    s.put("acme", "alice", make_block("m0"), cache=False)
    s.put("acme", "alice", make_block("m1"), cache=False)
    p0, p1 = [i.path for i in s.list("acme", "alice")]
    data = bytearray(open(p0, "rb").read())
    data[-100] ^= 1  # one bit of ciphertext
    open(p0, "wb").write(data)
    raw = open(p1, "rb").read()
    open(p1, "wb").write(raw.replace(b'"item":"m1"', b'"item":"m0"'))  # header says another item
    for item in ("m0", "m1"):
        with pytest.raises(BlobCorruptError, match=item):
            s.get_many("acme", "alice", [item], FP)
    assert s.stats()["corrupt"] == 2


def test_blob_sealed_under_an_unknown_key_is_refused(open_store, tmp_path, keyring):
    s = open_store(keyring=keyring)
    s.put("acme", "alice", make_block("m0"), cache=False)
    s.close()
    other = _kek(tmp_path / "other", "k1")  # same key id, another key
    s = open_store(keyring=other)
    with pytest.raises(BlobCorruptError, match="m0"):
        s.get_many("acme", "alice", ["m0"], FP)
    job = tmp_path / "job"
    save_block(make_block("m0"), job, keyring=keyring, tenant="acme", user="alice")
    with pytest.raises(BlobAuthError, match="does not unwrap") as e:
        s.import_dir("acme", "alice", job)
    assert base64.b64encode(other.keys["k1"]).decode() not in str(e.value)


def test_rotation_rewraps_and_the_old_key_can_be_dropped(open_store, tmp_path):
    k1 = _kek(tmp_path / "kek", "k1")
    s = open_store(keyring=k1)
    for i in range(3):
        s.put("acme" if i else "globex", "alice", make_block(f"m{i}"), cache=False)
    before = {i.path: open(i.path, "rb").read() for t in ("acme", "globex") for i in s.list(t, "alice")}
    s.close()
    line1 = (tmp_path / "kek").read_text()
    _write_kek(tmp_path / "kek", sealing.new_key_line("k2") + line1)  # k2 first: wraps from now on
    s = open_store(keyring=sealing.Keyring.load(tmp_path / "kek"))
    assert s.rotate_keys() == 3 and s.rotate_keys() == 0
    for path, old in before.items():
        new = open(path, "rb").read()
        a, b = (sealing.parse_sealed(x, source=path) for x in (old, new))
        assert (a.header["kid"], b.header["kid"]) == ("k1", "k2")
        assert new[b.body_offset :] == old[a.body_offset :]  # ciphertext and tag untouched
    s.close()
    _write_kek(tmp_path / "kek", (tmp_path / "kek").read_text().splitlines(keepends=True)[0])  # drop k1
    s = open_store(keyring=sealing.Keyring.load(tmp_path / "kek"))
    got, st = s.get_many("acme", "alice", ["m1", "m2"], FP)
    assert st.tiers["disk"] == 2 and torch.equal(got[1].kv, make_block("m2").kv)


def test_job_dir_import_of_sealed_blobs(open_store, tmp_path, keyring):
    job = tmp_path / "kv" / "acme" / "alice"
    for i in range(2):
        save_block(make_block(f"m{i}"), job, keyring=keyring, tenant="acme", user="alice")
    assert oct(os.stat(job / f"m0{SUFFIX}").st_mode & 0o777) == "0o600"
    with pytest.raises(BlobCorruptError, match="sealed blob"):
        load_block(job / f"m0{SUFFIX}")  # a plain reader cannot use it
    s = open_store(keyring=keyring)
    r = s.import_dir("acme", "alice", job)
    assert r.blocks == 2
    s.dram.drop(lambda k: True)
    got, _ = s.get_many("acme", "alice", ["m1"], FP)
    assert torch.equal(got[0].kv, make_block("m1").kv)


def test_keyring_file_errors_are_typed_and_never_echo_keys(tmp_path):
    good = base64.b64encode(b"x" * 32).decode()
    cases = {"": "holds no key", f"k1{good}": "expected", "k1:@@@": "not valid base64",
             f"k1:{base64.b64encode(b'short').decode()}": "5 bytes", f"k1:{good}\nk1:{good}": "twice",
             f"../k:{good}": "expected"}
    for text, msg in cases.items():
        _write_kek(tmp_path / "kek", text)
        with pytest.raises(ConfigError, match=msg) as e:
            sealing.Keyring.load(tmp_path / "kek")
        assert good not in str(e.value)
    with pytest.raises(ConfigError, match="cannot read"):
        sealing.Keyring.load(tmp_path / "missing")
    kr = sealing.ensure_kek_file(tmp_path / "new" / "kek")
    assert oct(os.stat(tmp_path / "new" / "kek").st_mode & 0o777) == "0o600"
    assert sealing.ensure_kek_file(tmp_path / "new" / "kek").keys == kr.keys  # created once, then kept


def test_a_plain_blob_on_a_sealed_store_disk_is_refused(open_store, keyring):
    s = open_store(keyring=keyring)
    s.put("acme", "alice", make_block("m0"), cache=False)
    path = s.list("acme", "alice")[0].path
    open(path, "wb").write(encode_blob(make_block("m0")) + b"\0" * 400)  # right sha, plain
    with pytest.raises(BlobCorruptError, match="m0"):
        s.get_many("acme", "alice", ["m0"], FP)


def test_peer_pull_is_sealed_under_the_pullers_key(open_store, tmp_path, keyring):
    root = tmp_path / "peer"
    with KVStore(root, dram_budget_bytes=8 << 20, nixl=False) as p:
        for it in ("m0", "m1"):
            p.put("acme", "alice", make_block(it, tokens=5))
    options = {"dram_budget_bytes": 8 << 20, "timeout_s": 10.0, "peer_secret": PEER_SECRET, "peer_tls": PEER_TLS, "preload": [("acme", "alice", FP)]}
    with child_process(serve_node, str(root), options) as info:
        s = open_store(keyring=keyring, timeout_s=10.0)
        assert s.pull_from_peer("acme", "alice", info["peer"]).blocks == 2
    for i in s.list("acme", "alice"):
        assert sealing.is_sealed(open(i.path, "rb").read(16))
    s.dram.drop(lambda k: True)
    got, st = s.get_many("acme", "alice", ["m0", "m1"], FP)
    assert st.tiers["disk"] == 2 and torch.equal(got[1].kv, make_block("m1", tokens=5).kv)


def test_keys_cli_add_then_rotate(tmp_path, capsys):
    from inferscale.cli import main

    kek = tmp_path / "kek"
    assert main(["keys", "add", "--kek-file", str(kek)]) == 0  # creates the file
    with KVStore(tmp_path / "data" / "store", dram_budget_bytes=8 << 20, nixl=False,
                 keyring=sealing.Keyring.load(kek)) as s:
        s.put("acme", "alice", make_block("m0"), cache=False)
    assert main(["keys", "add", "--kek-file", str(kek)]) == 0
    assert list(sealing.Keyring.load(kek).keys) == ["k2", "k1"] and os.stat(kek).st_mode & 0o777 == 0o600
    assert main(["keys", "add", "--kek-file", str(kek), "--id", "k1"]) == 2  # duplicate id: file unchanged
    assert main(["keys", "rotate", "--kek-file", str(kek), "--data-dir", str(tmp_path / "data")]) == 0
    assert "re-wrapped 1 blobs under key k2" in capsys.readouterr().out
    kek.write_text(kek.read_text().splitlines(keepends=True)[0])
    with KVStore(tmp_path / "data" / "store", dram_budget_bytes=8 << 20, nixl=False,
                 keyring=sealing.Keyring.load(kek)) as s:
        got, _ = s.get_many("acme", "alice", ["m0"], FP)
        assert torch.equal(got[0].kv, make_block("m0").kv)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the device tier)")
def test_sealed_blob_opens_into_pinned_dram_and_reaches_the_device(open_store, keyring):
    s = open_store(keyring=keyring, gpu_budget_bytes=8 << 20, device="cuda")
    s.put("acme", "alice", make_block("m0"), cache=False)
    got, st = s.get_many("acme", "alice", ["m0"], FP)
    assert st.tiers["disk"] == 1 and got[0].kv.is_cuda
    assert torch.equal(got[0].kv.cpu(), make_block("m0").kv)
    got, st = s.get_many("acme", "alice", ["m0"], FP)
    assert st.tiers["gpu"] == 1
