"""Sealed KV blobs: per-tenant authenticated encryption at rest (envelope encryption, AES-256-GCM).

A key-encryption key (KEK) file holds one key a line, ``<key-id>:<base64 of 32 random bytes>``; the first line
wraps new data keys, the others only unwrap (rotation). For each tenant a wrapping key is derived from a KEK with
HKDF-SHA256 (info = the tenant), so a blob moved into another tenant's directory cannot even unwrap its data key.
Each blob gets a random data key, wrapped under the tenant's wrapping key (AAD: tenant, key id); the whole plain
blob image (safetensors: tensors and metadata, memory text included) is encrypted under that data key with AAD
binding tenant, user, item, model fingerprint and the seal version, so a blob moved to another user or renamed to
another item fails too. Rotation re-wraps data keys under the current KEK line without touching the ciphertext.

Sealed file layout (``kvformat.SUFFIX``)::

    MAGIC (8) | header length (4, little endian) | header (JSON) | ciphertext (len = plain image) | GCM tag (16)

The header is not secret: item id, model fingerprint (a catalogue rebuild needs it), key id, wrapped data key,
nonce. Nothing here imports torch; errors never carry key bytes."""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from inferscale.errors import BlobAuthError, BlobCorruptError, ConfigError
from inferscale.secretfile import check_private

MAGIC = b"ISKVSEAL"
SEAL_VERSION = 1
SEAL_VERSION_GENERATION = 2  # the same, plus the item's generation ("gen") in the header and the body's AAD
TAG_BYTES = 16
NONCE_BYTES = 12
KEY_BYTES = 32
MAX_SEAL_HEADER = 64 << 10
_PREFIX = len(MAGIC) + 4
_KEY_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_CHUNK = 256 << 10  # decrypt through a cache-sized scratch buffer
_scratch = threading.local()


@dataclass
class Keyring:
    """The KEK lines of one file, in order: ``current`` wraps new data keys, every key unwraps."""

    keys: dict[str, bytes]
    source: str = "<keyring>"
    _derived: dict[tuple[str, str], bytes] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.keys:
            raise ConfigError(f"KEK file {self.source}: holds no key")

    @property
    def current(self) -> str:
        return next(iter(self.keys))

    @classmethod
    def from_text(cls, text: str, source: str = "<keyring>") -> Keyring:
        keys: dict[str, bytes] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            kid, sep, b64 = line.partition(":")
            if not sep or not _KEY_ID_RE.match(kid):
                raise ConfigError(f"KEK file {source} line {n}: expected <key-id>:<base64 of 32 bytes>")
            try:
                key = base64.b64decode(b64.strip(), validate=True)
            except (binascii.Error, ValueError):
                raise ConfigError(f"KEK file {source} line {n}: key {kid!r} is not valid base64") from None
            if len(key) != KEY_BYTES:
                raise ConfigError(f"KEK file {source} line {n}: key {kid!r} is {len(key)} bytes, expected {KEY_BYTES}")
            if kid in keys:
                raise ConfigError(f"KEK file {source} line {n}: key id {kid!r} appears twice")
            keys[kid] = key
        return cls(keys, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Keyring:
        check_private(path, "KEK file")  # a KEK others can read is refused at start (issue 24)
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"KEK file {path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
        return cls.from_text(text, str(path))

    def wrapping_key(self, kid: str, tenant: str) -> bytes:
        """The tenant's key-wrapping key under KEK ``kid`` (HKDF-SHA256, cached)."""
        with self._lock:
            wk = self._derived.get((kid, tenant))
            if wk is None:
                hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                            info=b"inferscale-kv-wrap/v1\0" + tenant.encode())
                wk = self._derived[(kid, tenant)] = hkdf.derive(self.keys[kid])
            return wk


def new_key_line(kid: str = "k1") -> str:
    return f"{kid}:{base64.b64encode(os.urandom(KEY_BYTES)).decode()}\n"


def ensure_kek_file(path: str | os.PathLike) -> Keyring:
    """Load the KEK file, creating it (0600, one fresh key) when missing: the single-node default."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process created it first: use theirs
            return Keyring.load(path)
        with os.fdopen(fd, "w") as f:
            f.write(new_key_line())
            f.flush()
            os.fsync(f.fileno())
    return Keyring.load(path)


@dataclass(frozen=True)
class Binding:
    """Where a blob belongs; it is authenticated with the blob, so a blob elsewhere fails to open."""

    tenant: str
    user: str
    item: str
    fingerprint: str
    # Which version of the item this is (a store's put numbers them, inferscale/store/versions.py): bound into
    # the AAD, so an older version restored on disk does not open as the current one. None: a v1 seal.
    generation: int | None = None

    def body_aad(self) -> bytes:
        if self.generation is None:
            return json.dumps(["inferscale-kv-seal", SEAL_VERSION, self.tenant, self.user, self.item,
                               self.fingerprint]).encode()
        return json.dumps(["inferscale-kv-seal", SEAL_VERSION_GENERATION, self.tenant, self.user, self.item,
                           self.fingerprint, self.generation]).encode()

    def __str__(self) -> str:
        return f"tenant {self.tenant!r} user {self.user!r} item {self.item!r}"


def _key_aad(tenant: str, kid: str) -> bytes:
    return json.dumps(["inferscale-kv-key", SEAL_VERSION, tenant, kid]).encode()


def _wrap(keyring: Keyring, tenant: str, data_key: bytes) -> dict[str, str]:
    kid = keyring.current
    nonce = os.urandom(NONCE_BYTES)
    wrapped = AESGCM(keyring.wrapping_key(kid, tenant)).encrypt(nonce, data_key, _key_aad(tenant, kid))
    return {"kid": kid, "wrap_nonce": base64.b64encode(nonce).decode(), "wrapped": base64.b64encode(wrapped).decode()}


def _unwrap(keyring: Keyring, header: dict, tenant: str, where: str) -> bytes:
    kid = header.get("kid")
    if kid not in keyring.keys:
        raise BlobAuthError(f"{where}: sealed under key {kid!r}, which the KEK file does not hold")
    try:
        nonce = base64.b64decode(header["wrap_nonce"])
        wrapped = base64.b64decode(header["wrapped"])
        return AESGCM(keyring.wrapping_key(kid, tenant)).decrypt(nonce, wrapped, _key_aad(tenant, kid))
    except (InvalidTag, KeyError, TypeError, ValueError, binascii.Error):
        raise BlobAuthError(f"{where}: its data key does not unwrap for this tenant (moved or forged)") from None


def is_sealed(data: bytes | memoryview) -> bool:
    return bytes(data[: len(MAGIC)]) == MAGIC


@dataclass(frozen=True)
class SealedLayout:
    header: dict
    body_offset: int  # where the ciphertext starts
    body_len: int  # = the plain image's size

    @property
    def item(self) -> str:
        return str(self.header.get("item", ""))

    @property
    def fingerprint(self) -> str:
        return str(self.header.get("fingerprint", ""))

    @property
    def generation(self) -> int | None:
        return self.header.get("gen") if self.header.get("v") == SEAL_VERSION_GENERATION else None


def parse_sealed(data: bytes | memoryview, *, source: str, total: int | None = None) -> SealedLayout:
    """The header of a sealed blob (``data`` may be just its first bytes when ``total`` is given)."""
    total = len(data) if total is None else total
    if not is_sealed(data):
        raise BlobAuthError(f"{source}: not a sealed KV blob (plain or foreign data is refused)")
    n = int.from_bytes(bytes(data[len(MAGIC) : _PREFIX]), "little")
    if n > MAX_SEAL_HEADER or _PREFIX + n > len(data) or _PREFIX + n + TAG_BYTES > total:
        raise BlobCorruptError(f"{source}: truncated sealed blob")
    try:
        header = json.loads(bytes(data[_PREFIX : _PREFIX + n]))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise BlobCorruptError(f"{source}: unreadable sealed header ({e})") from None
    if header.get("v") not in (SEAL_VERSION, SEAL_VERSION_GENERATION):
        raise BlobCorruptError(f"{source}: seal version {header.get('v')!r}, expected {SEAL_VERSION} or "
                               f"{SEAL_VERSION_GENERATION}")
    gen = header.get("gen")
    if header["v"] == SEAL_VERSION_GENERATION and (not isinstance(gen, int) or isinstance(gen, bool) or gen < 0):
        raise BlobCorruptError(f"{source}: sealed header without a generation")
    return SealedLayout(header, _PREFIX + n, total - _PREFIX - n - TAG_BYTES)


def _assemble(header: dict, body: bytes | memoryview, tag: bytes | memoryview) -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([MAGIC, len(h).to_bytes(4, "little"), h, bytes(body), bytes(tag)])


def seal(image: bytes | memoryview, keyring: Keyring, binding: Binding) -> bytes:
    """Encrypt and authenticate a plain blob image for ``binding`` under a fresh data key."""
    data_key = os.urandom(KEY_BYTES)
    nonce = os.urandom(NONCE_BYTES)
    sealed = AESGCM(data_key).encrypt(nonce, bytes(image), binding.body_aad())
    header = {"v": SEAL_VERSION, "item": binding.item, "fingerprint": binding.fingerprint,
              **_wrap(keyring, binding.tenant, data_key), "nonce": base64.b64encode(nonce).decode()}
    if binding.generation is not None:
        header.update(v=SEAL_VERSION_GENERATION, gen=binding.generation)
    return _assemble(header, memoryview(sealed)[:-TAG_BYTES], memoryview(sealed)[-TAG_BYTES:])


def open_into(sealed: memoryview, out: memoryview, keyring: Keyring, *, tenant: str, user: str, item: str,
              fingerprint: str | None = None, source: str = "<blob>", generation: int | None = None
              ) -> SealedLayout:
    """Authenticate and decrypt ``sealed`` into ``out[:body_len]``. ``out`` may be the same memory as
    ``sealed`` (the plain image then starts where the sealed file did: each chunk is decrypted into scratch
    before it is written back, and writes land below the bytes still to be read). With ``generation`` (the
    catalogue's current one; 0 stands for a v1 seal) a blob of any other generation is refused. On failure
    ``out`` holds garbage and BlobAuthError names the blob's place, never a key."""
    layout = parse_sealed(sealed, source=source)
    fp = layout.fingerprint if fingerprint is None else fingerprint
    binding = Binding(tenant, user, item, fp, layout.generation)
    if layout.item != item or layout.fingerprint != fp:
        raise BlobAuthError(f"{source}: sealed for item {layout.item!r}, not {binding}")
    if generation is not None and (layout.generation or 0) != generation:
        raise BlobAuthError(f"{source}: generation {layout.generation or 0} of {binding}, not the current "
                            f"{generation} (an older version restored?)")
    data_key = _unwrap(keyring, layout.header, tenant, f"{source} ({binding})")
    try:
        nonce = base64.b64decode(layout.header["nonce"])
        body_end = layout.body_offset + layout.body_len
        dec = Cipher(algorithms.AES(data_key), modes.GCM(nonce, bytes(sealed[body_end : body_end + TAG_BYTES]))
                     ).decryptor()
    except (KeyError, TypeError, ValueError, binascii.Error):
        raise BlobCorruptError(f"{source}: unreadable sealed header") from None
    dec.authenticate_additional_data(binding.body_aad())
    scratch = getattr(_scratch, "buf", None)
    if scratch is None:
        scratch = _scratch.buf = memoryview(bytearray(_CHUNK + TAG_BYTES))
    pos = 0
    try:
        while pos < layout.body_len:
            n = min(_CHUNK, layout.body_len - pos)
            got = dec.update_into(sealed[layout.body_offset + pos : layout.body_offset + pos + n], scratch)
            out[pos : pos + got] = scratch[:got]
            pos += got
        dec.finalize()
    except InvalidTag:
        raise BlobAuthError(f"{source}: fails authentication for {binding} (forged, tampered or moved)") from None
    return layout


def open_blob(data: bytes | memoryview, keyring: Keyring, *, tenant: str, user: str, item: str,
              fingerprint: str | None = None, source: str = "<blob>") -> memoryview:
    """The authenticated plain image of a sealed blob, as a new buffer."""
    sealed = memoryview(data).cast("B")
    layout = parse_sealed(sealed, source=source)
    out = memoryview(bytearray(layout.body_len))
    open_into(sealed, out, keyring, tenant=tenant, user=user, item=item, fingerprint=fingerprint, source=source)
    return out


def rewrap(data: bytes | memoryview, keyring: Keyring, *, tenant: str, source: str = "<blob>") -> bytes | None:
    """The blob with its data key re-wrapped under the current KEK line (ciphertext untouched), or None
    when it already is. BlobAuthError when its key cannot be unwrapped for ``tenant``."""
    layout = parse_sealed(data, source=source)
    if layout.header.get("kid") == keyring.current:
        return None
    data_key = _unwrap(keyring, layout.header, tenant, f"{source} (tenant {tenant!r})")
    header = {**layout.header, **_wrap(keyring, tenant, data_key)}
    end = layout.body_offset + layout.body_len
    view = memoryview(data)
    return _assemble(header, view[layout.body_offset : end], view[end : end + TAG_BYTES])
