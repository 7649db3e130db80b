"""Attacks through the path arguments of the internal plane: a pull whose ``source.dir`` names another tenant's
or user's blobs (directly, via '..', or via a symlink or hard link planted in the right directory), and the
same through a peer's ``dir``. Each must be refused with nothing imported."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from inferscale.engine.template import MemoryItem
from inferscale.errors import UnsafePathError
from inferscale.kvformat import SUFFIX, save_block
from inferscale.store import KVStore

from server_live_fixtures import KEYS
from store.helpers import PEER_SECRET  # tests/store/helpers.py (tests/ is on sys.path)

INTERNAL = {"Authorization": "Bearer internal-secret"}
TENANT, USER = "globex", "mallory"  # the attacker's UserMemory; the victim is acme/victim


@pytest.fixture
def dirs(live, tiny_engine, embedder):
    """The victim's Job output (acme/victim) and the attacker's own, empty dir, both on this node."""
    root = live.settings.kv_host_path
    victim, own = root / "acme" / "victim", root / TENANT / USER
    for b in tiny_engine.encode([MemoryItem("secret", "the victim's bank pin is 4321")], embed=embedder.embed):
        save_block(b, victim)
    own.mkdir(parents=True, exist_ok=True)
    yield root, victim, own
    if own.is_symlink():
        own.unlink()
    for d in (victim, own):
        shutil.rmtree(d, ignore_errors=True)


def _pull(live, directory: str):
    body = {"tenant": TENANT, "user": USER, "items": None,
            "source": {"node": live.settings.node_name, "dir": directory, "peer": None}}
    return httpx.post(live.internal_url + "/internal/v1/pull", json=body, headers=INTERNAL)


def _nothing_imported(live) -> bool:
    r = httpx.get(f"{live.url}/v1/memories/{USER}", headers={"Authorization": f"Bearer {KEYS[TENANT]}"})
    return r.status_code == 404


def _refused(live, directory: str) -> None:
    r = _pull(live, directory)
    assert r.status_code == 400, (directory, r.status_code, r.text)
    assert r.json()["error"]["param"] == "source.dir", r.text
    assert _nothing_imported(live)


def test_pull_of_another_tenants_dir(live, dirs):
    root, victim, _ = dirs
    _refused(live, str(victim))


def test_pull_via_dotdot(live, dirs):
    root, _, own = dirs
    _refused(live, str(own / ".." / ".." / "acme" / "victim"))
    _refused(live, f"{root}/acme/victim/../../{TENANT}/{USER}/../../acme/victim")


def test_pull_of_a_lookalike_dir_outside_the_kv_root(live, dirs, tmp_path):
    """Right tenant/user names, wrong place: blobs copied anywhere else on the node are not a Job's output."""
    _, victim, _ = dirs
    elsewhere = tmp_path / TENANT / USER
    shutil.copytree(victim, elsewhere)
    _refused(live, str(elsewhere))


def test_pull_via_a_symlinked_dir(live, dirs):
    root, victim, own = dirs
    own.rmdir()
    own.symlink_to(victim, target_is_directory=True)  # <root>/globex/mallory -> <root>/acme/victim
    _refused(live, str(own))


def test_pull_via_a_symlinked_blob_inside_the_right_dir(live, dirs):
    _, victim, own = dirs
    (blob,) = victim.glob(f"*{SUFFIX}")
    (own / blob.name).symlink_to(blob)
    _refused(live, str(own))


def test_pull_via_a_hard_link_inside_the_right_dir(live, dirs):
    _, victim, own = dirs
    (blob,) = victim.glob(f"*{SUFFIX}")
    os.link(blob, own / blob.name)
    _refused(live, str(own))


def test_import_dir_refuses_a_symlinked_dir_swapped_in_after_the_check(tmp_path, dirs):
    """The path check and the open are two steps: the importer itself must not follow a symlink."""
    _, victim, _ = dirs
    link = tmp_path / TENANT / USER
    link.parent.mkdir(parents=True)
    link.symlink_to(victim, target_is_directory=True)
    with KVStore(tmp_path / "store", dram_budget_bytes=16 << 20, nixl=False) as s:
        with pytest.raises(UnsafePathError):
            s.import_dir(TENANT, USER, link)
        assert s.catalogue.items(TENANT, USER) == []


def test_peer_refuses_a_dir_outside_its_kv_root(tmp_path, dirs):
    """A peer asked to import ``<anywhere>/<tenant>/<user>`` refuses: only its own KV host path counts."""
    root, victim, _ = dirs
    elsewhere = tmp_path / "elsewhere" / TENANT / USER
    shutil.copytree(victim, elsewhere)
    owner = KVStore(tmp_path / "a", dram_budget_bytes=16 << 20, peer_port=0, peer_host="127.0.0.1",
                    node="127.0.0.1", job_root=root, peer_secret=PEER_SECRET)
    puller = KVStore(tmp_path / "b", dram_budget_bytes=16 << 20, peer_secret=PEER_SECRET)
    try:
        for bad in (str(elsewhere), str(victim), f"{root}/{TENANT}/{USER}/../../acme/victim"):
            with pytest.raises(UnsafePathError):
                puller.pull_from_peer(TENANT, USER, owner.peer_address, source_dir=bad)
        assert owner.catalogue.items(TENANT, USER) == [] and puller.catalogue.items(TENANT, USER) == []
    finally:
        puller.close()
        owner.close()
