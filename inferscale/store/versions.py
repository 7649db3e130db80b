"""Which sealed version of an item is current, authenticated (G3, sealed stores only).

Every put seals its blob with a fresh per-item generation in the blob's associated data
(``sealing.Binding.generation``), and the catalogue row that names the current generation carries a MAC under a
key derived from the KEK (HKDF-SHA256, its own info label): an older sealed version of the same item restored on
disk no longer opens for the row (another generation), and a row edited to point at it (its sha256, size or
generation) no longer verifies. The row's retrieval embedding is sealed too (AES-GCM under another derived key,
bound to the row's key and generation), so the catalogue is no equality oracle for a guessed memory text; so is
its memory record (the text and token ids a recompute needs, inferscale/store/memrecord.py), under a key of its own.

Format of both (docs/interfaces.md, "Catalogue"): ``row_mac`` = ``<kid>:<hex HMAC-SHA256>`` over the JSON list
``[tenant, user, fingerprint, item, generation, sha256, size]``; a sealed embedding = ``kid length (1) | kid |
nonce (12) | ciphertext + tag``. What stays out of reach offline: a wholesale rollback of the store directory
(blobs and catalogue together) to an earlier copy, or a rebuild after the catalogue was lost (the blobs' own
generations are then all there is)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from inferscale.errors import BlobAuthError
from inferscale.sealing import KEY_BYTES, NONCE_BYTES, Keyring

ROWS_INFO = b"inferscale-catalogue-rows/v1"
EMBEDDING_INFO = b"inferscale-catalogue-embedding/v1"
MEMORY_INFO = b"inferscale-catalogue-memory/v1"
# A row's sealed fields: (HKDF info of its key, the first element of its AAD).
FIELDS = {"embedding": (EMBEDDING_INFO, "inferscale-embedding"), "memory": (MEMORY_INFO, "inferscale-memory")}

Key = tuple[str, str, str, str]  # tenant, user, fingerprint, item


class CatalogueSeal:
    """Row MACs, sealed embeddings and generation numbers of one store's catalogue, under its keyring."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring
        self._keys: dict[tuple[str, bytes], bytes] = {}
        self._lock = threading.Lock()
        self._last = 0

    def _key(self, kid: str, info: bytes) -> bytes:
        with self._lock:
            k = self._keys.get((kid, info))
            if k is None:
                hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info)
                k = self._keys[(kid, info)] = hkdf.derive(self.keyring.keys[kid])
            return k

    def next_generation(self, previous: int) -> int:
        """A generation above ``previous`` and above every one this process handed out (nanoseconds of the clock
        when that is higher, so generations also grow across restarts)."""
        with self._lock:
            self._last = max(previous + 1, self._last + 1, time.time_ns())
            return self._last

    # -- rows -----------------------------------------------------------------------------------------------
    def _row_mac(self, kid: str, key: Key, generation: int, sha256: str, size: int) -> str:
        body = json.dumps([*key, generation, sha256, size], separators=(",", ":")).encode()
        return hmac.new(self._key(kid, ROWS_INFO), body, hashlib.sha256).hexdigest()

    def row_mac(self, key: Key, generation: int, sha256: str, size: int) -> str:
        kid = self.keyring.current
        return f"{kid}:{self._row_mac(kid, key, generation, sha256, size)}"

    def row_ok(self, key: Key, generation: int, sha256: str, size: int, mac: str) -> bool:
        kid, _, got = mac.partition(":")
        if kid not in self.keyring.keys:
            return False
        return hmac.compare_digest(got.encode(), self._row_mac(kid, key, generation, sha256, size).encode())

    # -- sealed fields: the retrieval embedding and the memory record of a row --------------------------------
    def seal_field(self, name: str, key: Key, generation: int, plain: bytes) -> bytes:
        """``plain`` sealed as the row's field ``name`` (one of ``FIELDS``), bound to the row's key and generation."""
        info, label = FIELDS[name]
        kid = self.keyring.current
        nonce = os.urandom(NONCE_BYTES)
        ct = AESGCM(self._key(kid, info)).encrypt(nonce, plain, _aad(label, key, generation))
        return bytes([len(kid)]) + kid.encode() + nonce + ct

    def open_field(self, name: str, key: Key, generation: int, sealed: bytes) -> bytes:
        info, label = FIELDS[name]
        n = sealed[0] if sealed else 0
        kid = sealed[1 : 1 + n].decode(errors="replace")
        nonce, ct = sealed[1 + n : 1 + n + NONCE_BYTES], sealed[1 + n + NONCE_BYTES :]
        if kid not in self.keyring.keys:
            raise BlobAuthError(f"{name} of item {key[3]!r}: sealed under key {kid!r}, not in the KEK file")
        try:
            return AESGCM(self._key(kid, info)).decrypt(nonce, ct, _aad(label, key, generation))
        except (InvalidTag, ValueError):
            raise BlobAuthError(f"{name} of item {key[3]!r} fails authentication (tampered or moved)") from None

    def seal_embedding(self, key: Key, generation: int, plain: bytes) -> bytes:
        return self.seal_field("embedding", key, generation, plain)

    def open_embedding(self, key: Key, generation: int, sealed: bytes) -> bytes:
        return self.open_field("embedding", key, generation, sealed)


def _aad(label: str, key: Key, generation: int) -> bytes:
    return json.dumps([label, *key, generation], separators=(",", ":")).encode()
