"""`inferscale encode` / `ask` on a model directory, and their one-line errors on bad input."""

import json

import pytest

import tiny_models as tm
from inferscale.kvformat import SUFFIX
from inferscale.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen3")
    tm.model("qwen3").save_pretrained(d)
    tm.tokenizer().save_pretrained(d)
    return d


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_encode_then_ask(model_dir, tmp_path, capsys):
    items = _write(tmp_path / "m.jsonl", [{"id": "a", "text": "caroline went to paris"},
                                           {"id": "b", "text": "melanie painted the beach", "timestamp": "may 2023"}])
    out = tmp_path / "blobs"
    assert main(["encode", str(items), "--out", str(out), "--model", str(model_dir)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [f"a{SUFFIX}", f"b{SUFFIX}"]
    assert main(["ask", "where did caroline go?", "--blobs", str(out), "--model", str(model_dir), "--json",
                 "--max-tokens", "4"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["memories"] == 2 and result["memory_tokens"] > 0 and result["ttft_ms"] > 0
    # --only re-encodes just the named item
    before = (out / f"a{SUFFIX}").stat().st_mtime_ns
    assert main(["encode", str(items), "--out", str(out), "--model", str(model_dir), "--only", "b"]) == 0
    assert (out / f"a{SUFFIX}").stat().st_mtime_ns == before


@pytest.mark.parametrize("rows,message", [
    ([{"id": "a", "text": "   "}], "text is empty"),
    ([{"id": "a", "text": "ok"}, "{not json"], ":2: not valid JSON"),
    ([{"id": "../x", "text": "ok"}], "must match"),
    ([{"id": "a", "text": "ok"}, {"id": "a", "text": "again"}], "duplicate memory id 'a'"),
    ([{"id": "a", "text": "word " * 3000}], "do not fit the model's context"),
])
def test_bad_items_fail_with_one_line_and_keep_old_blobs(model_dir, tmp_path, capsys, rows, message):
    out = tmp_path / "blobs"
    good = _write(tmp_path / "good.jsonl", [{"id": "a", "text": "caroline went to paris"}])
    assert main(["encode", str(good), "--out", str(out), "--model", str(model_dir)]) == 0
    before = (out / f"a{SUFFIX}").read_bytes()
    capsys.readouterr()
    bad = _write(tmp_path / "bad.jsonl", rows)
    assert main(["encode", str(bad), "--out", str(out), "--model", str(model_dir)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("inferscale: error")]
    assert len(errors) == 1 and message in errors[0]
    assert (out / f"a{SUFFIX}").read_bytes() == before


def test_unknown_model_path(tmp_path, capsys):
    items = _write(tmp_path / "m.jsonl", [{"id": "a", "text": "x"}])
    assert main(["encode", str(items), "--out", str(tmp_path), "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_corrupt_and_foreign_blobs_are_named(model_dir, tmp_path, capsys):
    items = _write(tmp_path / "m.jsonl", [{"id": "a", "text": "caroline went to paris"}])
    out = tmp_path / "blobs"
    assert main(["encode", str(items), "--out", str(out), "--model", str(model_dir)]) == 0
    blob = out / f"a{SUFFIX}"
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0x55
    blob.write_bytes(bytes(data))
    assert main(["ask", "q?", "--blobs", str(out), "--model", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert f"a{SUFFIX}" in err and "checksum" in err
    # a blob from another model
    other = tmp_path / "other-model"
    tm.model("qwen3", seed=7).save_pretrained(other)
    tm.tokenizer().save_pretrained(other)
    assert main(["encode", str(items), "--out", str(out), "--model", str(other)]) == 0
    assert main(["ask", "q?", "--blobs", str(out), "--model", str(model_dir)]) == 2
    assert f"a{SUFFIX}: encoded for model" in capsys.readouterr().err


def test_encode_with_a_tenant_key_file_seals_what_the_fleet_kek_opens(model_dir, tmp_path, capsys):
    """Issue 24 #2: an encode Job holds only its tenant's derived keys; the servers' KEK opens what it sealed."""
    from inferscale.sealing import Keyring, is_sealed, new_key_line
    from inferscale.store import KVStore
    from inferscale.tenantkey import derive_text

    kek = tmp_path / "kek"
    kek.write_text(new_key_line("k1"))
    kek.chmod(0o600)
    tkey = tmp_path / "tenant-key"
    tkey.write_text(derive_text(Keyring.load(kek), "acme"))
    tkey.chmod(0o400)
    assert Keyring.load(kek).keys["k1"].hex() not in tkey.read_text() and "k1:" in tkey.read_text()
    items = _write(tmp_path / "m.jsonl", [{"id": "a", "text": "caroline went to paris"}])
    out = tmp_path / "kv" / "acme" / "alice"
    assert main(["encode", str(items), "--out", str(out), "--model", str(model_dir), "--kek-file", str(tkey),
                 "--tenant", "acme", "--user", "alice"]) == 0
    assert is_sealed((out / f"a{SUFFIX}").read_bytes())
    with KVStore(tmp_path / "store", dram_budget_bytes=8 << 20, nixl=False, keyring=Keyring.load(kek)) as s:
        assert s.import_dir("acme", "alice", out).blocks == 1
    capsys.readouterr()
    assert main(["encode", str(items), "--out", str(tmp_path / "o2"), "--model", str(model_dir), "--kek-file",
                 str(tkey), "--tenant", "globex", "--user", "alice"]) == 2
    assert "tenant 'acme'" in capsys.readouterr().err, "another tenant's Job cannot use this key file"


def test_encode_with_a_kek_seals_for_the_tenant_and_user(model_dir, tmp_path, capsys):
    from inferscale.sealing import Keyring, is_sealed, new_key_line
    from inferscale.store import KVStore

    kek = tmp_path / "kek"
    kek.write_text(new_key_line("k1"))
    kek.chmod(0o600)
    items = _write(tmp_path / "m.jsonl", [{"id": "a", "text": "caroline went to paris"},
                                          {"id": "b", "text": "melanie painted the beach"}])
    out = tmp_path / "kv" / "acme" / "alice"
    assert main(["encode", str(items), "--out", str(out), "--model", str(model_dir), "--kek-file", str(kek),
                 "--tenant", "acme", "--user", "alice"]) == 0
    for name in (f"a{SUFFIX}", f"b{SUFFIX}"):
        raw = (out / name).read_bytes()
        assert is_sealed(raw) and b"caroline" not in raw and (out / name).stat().st_mode & 0o777 == 0o600
    with KVStore(tmp_path / "store", dram_budget_bytes=8 << 20, nixl=False, keyring=Keyring.load(kek)) as s:
        assert s.import_dir("acme", "alice", out).blocks == 2
        assert [i.item_id for i in s.list("acme", "alice")] == ["a", "b"]
    # sealing needs all three flags; a half-given set fails before any model work, in one line
    capsys.readouterr()
    assert main(["encode", str(items), "--out", str(out), "--model", str(model_dir), "--kek-file", str(kek),
                 "--tenant", "acme"]) == 2
    assert "--kek-file, --tenant and --user together" in capsys.readouterr().err


def test_encode_kv_dtype_writes_compact_blobs_that_ask_injects(model_dir, tmp_path, capsys):
    from inferscale.kvformat import load_block

    items = _write(tmp_path / "m.jsonl", [{"id": "a", "text": "caroline went to paris"},
                                           {"id": "b", "text": "melanie painted the beach"}])
    plain, packed = tmp_path / "plain", tmp_path / "int8"
    assert main(["encode", str(items), "--out", str(plain), "--model", str(model_dir)]) == 0
    assert main(["encode", str(items), "--out", str(packed), "--model", str(model_dir), "--kv-dtype", "int8"]) == 0
    a_plain, a_int8 = load_block(plain / f"a{SUFFIX}"), load_block(packed / f"a{SUFFIX}")
    assert a_plain.kv_dtype == "bf16" and a_int8.kv_dtype == "int8" and a_int8.nbytes == a_plain.nbytes * (16 + 4) // (16 * a_plain.kv.element_size())
    # head_dim 16: 16 int8 codes + a float32 scale per row; within half an int8 step of the model-dtype KV
    assert (a_int8.float_kv() - a_plain.kv.float()).abs().max() <= a_plain.kv.float().abs().max() / 254 * 1.01
    capsys.readouterr()
    assert main(["ask", "where did caroline go?", "--blobs", str(packed), "--model", str(model_dir), "--json",
                 "--max-tokens", "4"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memories"] == 2
    with pytest.raises(SystemExit) as e:  # argparse choices: a usage error, nothing written
        main(["encode", str(items), "--out", str(tmp_path / "x"), "--model", str(model_dir), "--kv-dtype", "int3"])
    assert e.value.code == 2
    assert not (tmp_path / "x").exists()


def test_server_setting_kv_dtype():
    from inferscale.errors import ConfigError
    from inferscale.server.settings import Settings

    assert Settings.from_env({}).kv_dtype == "bf16"
    assert Settings.from_env({"INFERSCALE_KV_DTYPE": "int8"}).kv_dtype == "int8"
    with pytest.raises(ConfigError, match="INFERSCALE_KV_DTYPE"):
        Settings.from_env({"INFERSCALE_KV_DTYPE": "int3"})
