"""Store API: round trips, tenant scoping, typed errors for bad input."""

import pytest
import torch

from inferscale.kvformat import SUFFIX
from inferscale.errors import BlobCorruptError, ConfigError, FingerprintMismatchError, InvalidInputError, NotFoundError
from inferscale.kvformat import save_block
from inferscale.store import KVStore

from .helpers import FP, OTHER_FP, make_block


def test_put_get_roundtrip(open_store):
    s = open_store()
    blocks = [make_block(f"m{i}", tokens=3 + i) for i in range(4)]
    for b in blocks:
        s.put("acme", "alice", b, cache=False)
    got, stats = s.get_many("acme", "alice", ["m2", "m0", "m3"], FP)
    assert [b.item_id for b in got] == ["m2", "m0", "m3"]
    for g, want in zip(got, [blocks[2], blocks[0], blocks[3]]):
        assert torch.equal(g.kv, want.kv) and torch.equal(g.embedding, want.embedding)
        assert (g.text, g.token_ids, g.start_pos, g.timestamp) == (want.text, want.token_ids, 7, "2023-05-08")
        assert g.model_fingerprint == FP and g.prefix_sha256 == want.prefix_sha256
    assert stats.tiers == {"gpu": 0, "dram": 0, "disk": 3} and stats.bytes == sum(b.nbytes for b in got)
    _, stats = s.get_many("acme", "alice", ["m0", "m1"], FP)
    assert stats.served == {"m0": "dram", "m1": "disk"}
    assert stats.as_attributes()["kv.blocks"] == 2


def test_list_users_embeddings(open_store):
    s = open_store()
    for i in range(3):
        s.put("acme", "alice", make_block(f"m{i}"))
    s.put("acme", "alice", make_block("noemb", embed=False))
    s.put("acme", "bob", make_block("x"))
    infos = s.list("acme", "alice")
    assert [i.item_id for i in infos] == ["m0", "m1", "m2", "noemb"]
    assert all(i.tiers == ["dram", "disk"] and len(i.sha256) == 64 and i.tokens == 4 for i in infos)
    assert s.users("acme") == ["alice", "bob"]
    ids, emb = s.embeddings("acme", "alice", FP)
    assert ids == ["m0", "m1", "m2"] and emb.shape == (3, 16)
    assert torch.equal(emb[1], make_block("m1").embedding)


def test_user_tokens_count_one_users_usable_memories_of_one_model(open_store):
    s = open_store()
    for i, n in enumerate((3, 5, 8)):
        s.put("acme", "alice", make_block(f"m{i}", tokens=n))
    s.put("acme", "alice", make_block("other", tokens=6, fp=OTHER_FP))
    s.put("acme", "bob", make_block("b", tokens=9))
    s.put("globex", "alice", make_block("g", tokens=7))
    assert s.catalogue.user_tokens("acme", "alice", FP) == (3, 16)
    s.catalogue.set_flag([("acme", "alice", FP, "m2")], "corrupt", 1)
    assert s.catalogue.user_tokens("acme", "alice", FP) == (2, 8)
    assert s.catalogue.user_tokens("acme", "carol", FP) == (0, 0)


def test_cross_tenant_access_refused(open_store):
    s = open_store()
    same = make_block("m1")
    s.put("tenantA", "alice", same)
    for call in (lambda: s.get_many("tenantB", "alice", ["m1"], FP), lambda: s.list("tenantB", "alice"),
                 lambda: s.users("tenantB"), lambda: s.embeddings("tenantB", "alice", FP),
                 lambda: s.delete("tenantB", "alice", "m1"), lambda: s.pin("tenantB", "alice", ["m1"])):
        with pytest.raises(NotFoundError) as e:
            call()
        assert "tenantA" not in str(e.value)  # the error does not leak the owner
    assert s.purge("tenantB", "alice") == (0, 0)
    # identical content in tenant B is a separate copy: no cross-tenant dedup
    s.put("tenantB", "alice", same)
    a, b = s.list("tenantA", "alice")[0], s.list("tenantB", "alice")[0]
    assert a.sha256 == b.sha256 and a.path != b.path
    assert s.delete("tenantA", "alice") == 1
    got, _ = s.get_many("tenantB", "alice", ["m1"], FP)
    assert torch.equal(got[0].kv, same.kv)
    with pytest.raises(NotFoundError):
        s.get_many("tenantA", "alice", ["m1"], FP)


def test_unknown_names_are_typed_not_found(open_store):
    s = open_store()
    s.put("acme", "alice", make_block("m1"))
    with pytest.raises(NotFoundError, match="tenant 'nobody'"):
        s.users("nobody")
    with pytest.raises(NotFoundError, match="user 'carol'"):
        s.get_many("acme", "carol", ["m1"], FP)
    with pytest.raises(NotFoundError, match="m9"):
        s.get_many("acme", "alice", ["m1", "m9"], FP)
    with pytest.raises(NotFoundError):
        s.delete("acme", "alice", "m9")
    with pytest.raises(FingerprintMismatchError):
        s.get_many("acme", "alice", ["m1"], OTHER_FP)


@pytest.mark.parametrize("bad", ["../etc", "a/b", ".hidden", "", "x" * 200, "a..b", None])
def test_bad_names_rejected(open_store, bad):
    s = open_store()
    with pytest.raises(InvalidInputError):
        s.put(bad, "alice", make_block("m1"))
    with pytest.raises(InvalidInputError):
        s.get_many("acme", bad, ["m1"], FP)
    if bad is not None:
        with pytest.raises(InvalidInputError):
            s.put("acme", "alice", make_block(bad))


def test_budget_smaller_than_a_block_is_config_error(tmp_path, open_store):
    with pytest.raises(ConfigError, match="smaller than one block"):
        KVStore(tmp_path / "a", dram_budget_bytes=1000, nixl=False)
    with pytest.raises(ConfigError, match="non-negative"):
        KVStore(tmp_path / "b", dram_budget_bytes=-5, nixl=False)
    s = open_store(tmp_path / "c", dram_budget_bytes=4 << 20, min_block_bytes=1)
    s.put("acme", "alice", make_block("big", tokens=16))  # ~512 KiB
    s.close()
    with pytest.raises(ConfigError, match="DRAM budget"):  # the catalogue knows the largest block
        KVStore(tmp_path / "c", dram_budget_bytes=300 << 10, min_block_bytes=1, nixl=False)
    with pytest.raises(ConfigError, match="tenant quota"):
        KVStore(tmp_path / "d", dram_budget_bytes=4 << 20, tenant_quota_bytes=10, nixl=False)


def test_delete_and_purge(open_store):
    s = open_store()
    for i in range(3):
        s.put("acme", "alice", make_block(f"m{i}"))
    paths = [i.path for i in s.list("acme", "alice")]
    assert s.delete("acme", "alice", "m0") == 1
    assert [i.item_id for i in s.list("acme", "alice")] == ["m1", "m2"]
    blocks, nbytes = s.purge("acme", "alice")
    assert blocks == 2 and nbytes > 0
    assert s.purge("acme", "alice") == (0, 0)
    assert not any(__import__("os").path.exists(p) for p in paths)
    with pytest.raises(NotFoundError):
        s.list("acme", "alice")
    assert s.stats()["dram_blocks"] == 0


def test_import_dir(open_store, tmp_path):
    job = tmp_path / "job"
    for i in range(3):
        save_block(make_block(f"m{i}"), job)
    s = open_store()
    r = s.import_dir("acme", "alice", job)
    assert (r.blocks, r.tier) == (3, "dram") and r.bytes > 0
    got, stats = s.get_many("acme", "alice", ["m2"], FP)
    assert stats.served == {"m2": "dram"} and torch.equal(got[0].kv, make_block("m2").kv)
    with pytest.raises(NotFoundError):
        s.import_dir("acme", "alice", job, ["nope"])
    (job / f"m1{SUFFIX}").write_bytes(b"garbage")
    with pytest.raises(BlobCorruptError, match="m1"):
        s.import_dir("acme", "bob", job)
    with pytest.raises(NotFoundError):  # nothing of a failed import was stored
        s.list("acme", "bob")


def test_zero_copy_views_hold_their_slot(open_store):
    s = open_store(dram_budget_bytes=600 << 10, min_block_bytes=1)  # room for 4 blocks of ~132 KiB
    for i in range(4):
        s.put("acme", "alice", make_block(f"m{i}"))
    held, _ = s.get_many("acme", "alice", ["m0"], FP)
    owned, _ = s.get_many("acme", "alice", ["m0"], FP, copy=True)
    assert owned[0].kv.data_ptr() != held[0].kv.data_ptr()
    for i in range(4, 8):  # pressure: m0 is LRU but in use, so others go
        s.put("acme", "alice", make_block(f"m{i}"))
        s.get_many("acme", "alice", [f"m{i}"], FP)
    assert torch.equal(held[0].kv, make_block("m0").kv)
    assert "dram" in [i for i in s.list("acme", "alice") if i.item_id == "m0"][0].tiers
    del held
    for i in range(4):
        s.get_many("acme", "alice", [f"m{i + 4}", f"m{(i + 1) % 4 + 4}"], FP)
    s.put("acme", "alice", make_block("m9"))
    assert "dram" not in [i for i in s.list("acme", "alice") if i.item_id == "m0"][0].tiers


def test_each_view_of_a_hit_holds_its_slot_on_its_own(open_store):
    """A DRAM hit's kv and scales are separate zero-copy views, each holding the slot: a reader that keeps only
    the scales, or only a slice of the kv, still reads the bytes it was served while the cache churns."""
    from inferscale.kvformat import compact

    s = open_store(dram_budget_bytes=600 << 10, min_block_bytes=1)
    want = compact(make_block("m0", tokens=16), "int8")
    s.put("acme", "alice", want)
    for i in range(1, 4):
        s.put("acme", "alice", compact(make_block(f"m{i}", tokens=16), "int8"))
    (hit,), stats = s.get_many("acme", "alice", ["m0"], FP)
    assert stats.served == {"m0": "dram"}
    scale, kv_part = hit.kv_scale, hit.kv[1]
    assert scale.data_ptr() != hit.kv_scale.clone().data_ptr()  # a view of the slot, not a copy
    del hit
    for i in range(4, 12):  # pressure: every other block is pushed through the cache
        s.put("acme", "alice", compact(make_block(f"m{i}", tokens=16), "int8"))
        s.get_many("acme", "alice", [f"m{i}"], FP)
    assert torch.equal(scale, want.kv_scale) and torch.equal(kv_part, want.kv[1])


def test_a_hit_hands_out_its_own_metadata(open_store):
    """Metadata is parsed once per cached image; each reader still gets its own token list and extra dict."""
    s = open_store()
    s.put("acme", "alice", make_block("m0"))
    (a,), _ = s.get_many("acme", "alice", ["m0"], FP)
    a.token_ids.append(99)
    a.extra["x"] = "y"
    (b,), stats = s.get_many("acme", "alice", ["m0"], FP)
    assert stats.served == {"m0": "dram"}
    assert b.token_ids == [0, 1, 2, 3] and b.extra == {}
    assert torch.equal(b.embedding, make_block("m0").embedding)
