"""The memory domain (inferscale/memories.py) against a real sealed KVStore, the real engine worker and the real
offline embedder, without HTTP: order, re-encoding on edit and delete, the catalogued context, listing, retrieval."""

from __future__ import annotations

import asyncio
import base64
import os

import pytest
import tiny_models
import torch

from inferscale import sealing
from inferscale.engine.template import MemoryItem
from inferscale.engine.worker import EngineWorker
from inferscale.errors import NotFoundError
from inferscale.memories import MemoryBook
from inferscale.retrieval import Embedder
from inferscale.store import KVStore

T, U = "acme", "alice"
FACTS = ["Alice lives in Lyon.", "Alice's sister is called Maud.", "Alice plays the cello on Sundays.",
         "Alice is allergic to peanuts.", "Alice drives a green van."]


@pytest.fixture(scope="module")
def engine():
    return tiny_models.engine("gemma3")


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture()
def book(tmp_path, engine, embedder):
    keyring = sealing.Keyring.from_text(f"k1:{base64.b64encode(os.urandom(32)).decode()}\n")
    store = KVStore(tmp_path / "store", dram_budget_bytes=64 << 20, nixl=False, keyring=keyring)
    worker = EngineWorker(engine)
    yield MemoryBook(store, embedder, worker, engine)
    worker.close()
    store.close()


def items(*n: int) -> list[MemoryItem]:
    return [MemoryItem(f"m{i}", FACTS[i]) for i in n]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float noise: the encoder packs segments differently for different batches."""
    return torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def run(coro):
    return asyncio.run(coro)


def test_items_are_encoded_behind_the_ones_before_them_and_the_catalogue_says_so(book):
    done = run(book.put(T, U, items(0, 1, 2)))
    assert (done.encoded, done.removed) == (3, 0) and done.bytes > 0
    rows = book.ordered(book.store.list(T, U))
    assert [r.item_id for r in rows] == ["m0", "m1", "m2"]
    assert {r.item_id: r.context for r in rows} == {"m0": (), "m1": ("m0",), "m2": ("m0", "m1")}


def test_a_later_put_appends_and_a_stored_id_keeps_its_place(book):
    run(book.put(T, U, items(0, 1)))
    run(book.put(T, U, items(2)))
    run(book.put(T, U, [MemoryItem("m0", "Alice moved to Nantes.")]))
    assert [r.item_id for r in book.ordered(book.store.list(T, U))] == ["m0", "m1", "m2"]
    listed = {m.id: m.text for m in run(book.list(T, U))}
    assert listed == {"m0": "Alice moved to Nantes.", "m1": FACTS[1], "m2": FACTS[2]}


def test_editing_an_item_re_encodes_the_items_behind_it(book, engine):
    run(book.put(T, U, items(0, 1, 2)))
    before = {b.item_id: b.kv.clone() for b in book.store.get_many(T, U, ["m1", "m2"], book.fingerprint)[0]}
    run(book.put(T, U, [MemoryItem("m0", "Alice moved to Nantes.")]))
    after = {b.item_id: b.kv for b in book.store.get_many(T, U, ["m1", "m2"], book.fingerprint)[0]}
    # The same as encoding the edited list from scratch: the old text of m0 lives on in no block.
    fresh = {b.item_id: b.kv for b in engine.encode([MemoryItem("m0", "Alice moved to Nantes."), *items(1, 2)])}
    for i in ("m1", "m2"):
        assert not same(before[i], after[i])
        assert same(after[i], fresh[i])


def test_deleting_an_item_re_encodes_exactly_the_items_that_named_it(book, engine):
    run(book.put(T, U, items(0, 1, 2)))
    old_m2 = book.store.get_many(T, U, ["m2"], book.fingerprint, copy=True)[0][0].kv
    encoded: list[set[str]] = []
    real = book.worker.call

    async def spy(fn):
        blocks = await real(fn)
        encoded.append({b.item_id for b in blocks})
        return blocks

    book.worker.call = spy
    gone = run(book.delete(T, U, "m1"))
    assert gone.blocks == 1 and gone.bytes > 0
    assert encoded == [{"m2"}]  # m0 was encoded behind nothing: untouched
    rows = {r.item_id: r.context for r in book.store.list(T, U)}
    assert rows == {"m0": (), "m2": ("m0",)}
    m2 = book.store.get_many(T, U, ["m2"], book.fingerprint)[0][0]
    fresh = {b.item_id: b.kv for b in engine.encode(items(0, 2))}["m2"]
    assert same(m2.kv, fresh) and not same(old_m2, fresh)  # m1 lives on in no block


def test_replace_makes_the_list_exactly_the_upload(book):
    run(book.put(T, U, items(0, 1, 2)))
    done = run(book.put(T, U, items(3, 1), replace=True))
    assert done.removed == 2
    rows = book.ordered(book.store.list(T, U))
    assert [r.item_id for r in rows] == ["m3", "m1"]  # the upload's order, a kept id included
    assert [r.context for r in rows] == [(), ("m3",)]  # each behind exactly the items before it in that order
    assert {r.item_id: r.context for r in book.store.list(T, U)}["m1"] == ("m3",)


def test_admit_sees_the_rows_and_its_charge_can_refuse_before_the_disk(book):
    run(book.put(T, U, items(0)))
    seen: list[list[str]] = []

    class Refused(Exception):
        pass

    async def admit(rows):
        seen.append([r.item_id for r in rows])

        def charge(blocks):
            raise Refused(f"{len(blocks)} blocks")

        return charge

    with pytest.raises(Refused):
        run(book.put(T, U, items(1), admit=admit))
    assert seen == [["m0"]]
    assert [r.item_id for r in book.store.list(T, U)] == ["m0"]


def test_unknown_user_and_item_are_not_found(book):
    with pytest.raises(NotFoundError):
        run(book.list(T, "nobody"))
    with pytest.raises(NotFoundError):
        run(book.delete(T, "nobody"))
    run(book.put(T, U, items(0)))
    with pytest.raises(NotFoundError):
        run(book.delete(T, U, "m9"))


def test_search_and_fetch_return_the_relevant_memory_in_injection_order(book):
    run(book.put(T, U, items(0, 1, 2, 3, 4)))
    chosen, candidates = book.search(T, U, "Which instrument does Alice play?", 2)
    assert candidates == 5 and chosen[0] == "m2" and len(chosen) == 2
    blocks, stats = book.fetch(T, U, chosen)
    assert [b.item_id for b in blocks] == chosen[::-1]  # least relevant first, best nearest the question
    assert sum(stats.tiers.values()) == 2
    assert book.search(T, U, "anything", 0) == ([], 5)


def test_an_old_catalogue_without_context_is_rebuilt_with_it(tmp_path, engine, embedder):
    import sqlite3

    store = KVStore(tmp_path / "s", dram_budget_bytes=64 << 20, nixl=False)
    worker = EngineWorker(engine)
    try:
        run(MemoryBook(store, embedder, worker, engine).put(T, U, items(0, 1)))
    finally:
        worker.close()
        store.close()
    db = sqlite3.connect(tmp_path / "s" / "catalogue.sqlite")
    db.execute("ALTER TABLE items DROP COLUMN context")
    db.commit()
    db.close()
    with KVStore(tmp_path / "s", dram_budget_bytes=64 << 20, nixl=False) as reopened:
        assert {r.item_id: r.context for r in reopened.list(T, U)} == {"m0": (), "m1": ("m0",)}
