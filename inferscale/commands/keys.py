"""``inferscale keys add|rotate``: the KEK file that seals blobs at rest (``inferscale.sealing``).

``add`` puts a fresh key first in the file (it wraps new data keys from then on; the old lines still unwrap).
``rotate`` re-wraps every sealed blob of a server's store under the file's first key, without re-encrypting
them; afterwards the old lines can be removed. Run ``rotate`` with that server stopped: it opens the store."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from inferscale.errors import ConfigError

ROTATE_DRAM_BYTES = 1 << 30  # address space only: rotation never loads a blob into DRAM


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["add", "rotate"])
    p.add_argument("--kek-file", required=True, help="the KEK file (<key-id>:<base64 of 32 bytes> a line)")
    p.add_argument("--id", default=None, help="add: the new key's id (default: k<n+1>)")
    p.add_argument("--data-dir", default=None, help="rotate: the server's data dir (its store is DATA_DIR/store)")


def run(args: argparse.Namespace) -> int:
    from inferscale import sealing
    from inferscale.kvformat import atomic_write

    path = Path(args.kek_file)
    if args.action == "add":
        old = sealing.Keyring.load(path) if path.exists() else None
        kid = args.id or f"k{len(old.keys) + 1 if old else 1}"
        text = sealing.new_key_line(kid) + (path.read_text() if old else "")
        sealing.Keyring.from_text(text, str(path))  # a bad or duplicate id fails before the file changes
        atomic_write(path, text.encode())
        print(f"key {kid} added first in {path}; run 'inferscale keys rotate' to re-wrap stored blobs")
        return 0
    if not args.data_dir:
        raise ConfigError("keys rotate needs --data-dir")
    from inferscale.store import KVStore

    store_dir = Path(args.data_dir) / "store"
    if not store_dir.is_dir():
        raise ConfigError(f"no store at {store_dir}")
    keyring = sealing.Keyring.load(path)
    with KVStore(store_dir, dram_budget_bytes=ROTATE_DRAM_BYTES, nixl=False, keyring=keyring) as store:
        n = store.rotate_keys()
    print(f"re-wrapped {n} blobs under key {keyring.current}; lines after the first can now be removed"
          f" from {os.fspath(path)}")
    return 0
