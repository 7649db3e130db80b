"""Reading KV blobs (``inferscale.kvformat``) in place from raw bytes: a DRAM arena slot or a file header.

The store moves whole blob images (header + tensors) between tiers, so one byte range per item travels and
the checksum in the header can be verified wherever the bytes land, without decoding through safetensors."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from inferscale import kvquant, sealing
from inferscale.contract import DEFAULT_KV_DTYPE
from inferscale.errors import BlobCorruptError
from inferscale.kvformat import FORMAT_VERSION, SUFFIX, TEMP_SUFFIX, KVBlock, atomic_write

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
}
MAX_HEADER = 64 << 20  # a header larger than this is garbage, not a KV blob


@dataclass(frozen=True)
class BlobInfo:
    """Where the tensors sit inside one blob image, and its metadata."""

    meta: dict[str, str]
    size: int  # bytes of the whole blob image
    kv_range: tuple[int, int]
    kv_dtype: torch.dtype
    kv_shape: tuple[int, ...]
    emb_range: tuple[int, int] | None
    emb_shape: tuple[int, ...] | None
    scale_range: tuple[int, int] | None = None  # kv_scale of a compact format (float32)
    scale_shape: tuple[int, ...] | None = None

    @property
    def format(self) -> str:
        """The blob's kv storage format (``kvquant``): bf16 for blobs written before compact formats."""
        return self.meta.get("kv_dtype", DEFAULT_KV_DTYPE)

    @property
    def item_id(self) -> str:
        return self.meta.get("item_id", "")

    @property
    def fingerprint(self) -> str:
        return self.meta.get("model_fingerprint", "")

    @property
    def sha256(self) -> str:
        return self.meta.get("sha256", "")

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV as stored: the compact tensor plus its scales."""
        n = self.kv_range[1] - self.kv_range[0]
        return n + (self.scale_range[1] - self.scale_range[0] if self.scale_range else 0)

    @property
    def tokens(self) -> int:
        return self.kv_shape[3] if len(self.kv_shape) == 5 else 0

    @property
    def context(self) -> tuple[str, ...]:
        """Ids of the items this block was encoded behind (the encoder's ``extra["context"]``, comma-joined)."""
        try:
            extra = json.loads(self.meta.get("extra") or "{}")
        except ValueError:
            return ()
        context = extra.get("context", "") if isinstance(extra, dict) else ""
        return tuple(i for i in str(context).split(",") if i)


def parse_header(head: bytes | memoryview, *, source: str, total: int | None = None) -> BlobInfo:
    """Parse the safetensors header at the start of ``head`` (which may be just the header bytes)."""
    try:
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        n = int.from_bytes(bytes(head[:8]), "little")
        if n > MAX_HEADER or 8 + n > len(head):
            raise ValueError("truncated header")
        header = json.loads(bytes(head[8 : 8 + n]))
        meta = header.pop("__metadata__", {}) or {}
        kv = header["kv"]
        start = 8 + n
        kv_range = (start + kv["data_offsets"][0], start + kv["data_offsets"][1])
        emb = header.get("embedding")
        emb_range = (start + emb["data_offsets"][0], start + emb["data_offsets"][1]) if emb else None
        sc = header.get("kv_scale")
        scale_range = (start + sc["data_offsets"][0], start + sc["data_offsets"][1]) if sc else None
        if sc is not None and sc["dtype"] != "F32":
            raise ValueError(f"kv_scale dtype {sc['dtype']}, expected F32")
        end = max([kv_range[1]] + [r[1] for r in (emb_range, scale_range) if r])
        dtype = _DTYPES[kv["dtype"]]
        shape = tuple(int(s) for s in kv["shape"])
    except (ValueError, KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BlobCorruptError(f"{source}: not a readable KV blob ({e})") from None
    if meta.get("format") != "inferscale-kv" or meta.get("format_version") != FORMAT_VERSION:
        raise BlobCorruptError(f"{source}: not an InferScale KV blob of format {FORMAT_VERSION}")
    if len(shape) != 5 or shape[1] != 2:
        raise BlobCorruptError(f"{source}: kv shape {shape} is not [layers, 2, heads, tokens, dim]")
    if total is not None and end != total:
        raise BlobCorruptError(f"{source}: blob is {total} bytes, header describes {end}")
    scale_shape = tuple(int(s) for s in sc["shape"]) if sc else None
    kvquant.check_layout(meta.get("kv_dtype", DEFAULT_KV_DTYPE), dtype, shape, scale_shape, source=source)
    return BlobInfo(
        meta=meta, size=end, kv_range=kv_range, kv_dtype=dtype, kv_shape=shape, emb_range=emb_range,
        emb_shape=tuple(emb["shape"]) if emb else None, scale_range=scale_range, scale_shape=scale_shape,
    )


def read_header(path: Path) -> BlobInfo:
    """Parse a blob file's header without reading its tensors."""
    try:
        with open(path, "rb") as f:
            first = f.read(8)
            n = int.from_bytes(first, "little") if len(first) == 8 else 0
            if n > MAX_HEADER:
                raise BlobCorruptError(f"{path}: not a readable KV blob (header of {n} bytes)")
            head = first + f.read(n)
            total = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise BlobCorruptError(f"{path}: cannot read ({e.strerror or e})") from None
    return parse_header(head, source=str(path), total=total)


def tensor_digest(image: memoryview, info: BlobInfo) -> str:
    """sha256 of the tensor bytes (kv, kv_scale, embedding), as ``kvformat.tensor_sha256`` computes it."""
    h = hashlib.sha256()
    h.update(image[info.kv_range[0] : info.kv_range[1]])  # hashlib drops the GIL on large buffers
    if info.scale_range is not None:
        h.update(image[info.scale_range[0] : info.scale_range[1]])
    if info.emb_range is not None:
        h.update(image[info.emb_range[0] : info.emb_range[1]])
    return h.hexdigest()


def verify(image: memoryview, *, source: str, expect_sha: str | None, expect_item: str | None = None,
           expect_fingerprint: str | None = None, digest: bool = True) -> BlobInfo:
    """Parse and check one blob image: header sane, sha256 of its tensors equals the header's and ``expect_sha``
    (the catalogue's or the peer's), item and fingerprint as expected. Raises BlobCorruptError.

    ``digest=False`` skips hashing the tensors, for an image just opened from a sealed blob: AES-GCM has
    authenticated every byte of it (the header's sha256 is still compared with ``expect_sha``)."""
    info = parse_header(image, source=source, total=len(image))
    digest = tensor_digest(image, info) if digest else info.sha256
    if digest != info.sha256 or (expect_sha is not None and digest != expect_sha):
        raise BlobCorruptError(f"{source}: checksum mismatch (item {info.item_id!r})")
    if expect_item is not None and info.item_id != expect_item:
        raise BlobCorruptError(f"{source}: holds item {info.item_id!r}, expected {expect_item!r}")
    if expect_fingerprint is not None and info.fingerprint != expect_fingerprint:
        raise BlobCorruptError(f"{source}: holds model {info.fingerprint[:16]}, expected {expect_fingerprint[:16]}")
    return info


def block_from_image(image: torch.Tensor, info: BlobInfo, *, kv: torch.Tensor | None = None) -> KVBlock:
    """A KVBlock over a uint8 blob image. ``kv`` overrides the kv tensor (e.g. a GPU copy); otherwise the kv is
    a zero-copy view of ``image`` when aligned (the caller keeps the image alive), else a copy."""
    if kv is None:
        kv = _view(image, info.kv_range, info.kv_dtype, info.kv_shape)
    scale = None
    if info.scale_range is not None:
        scale = _view(image, info.scale_range, kvquant.SCALE_DTYPE, info.scale_shape)
    emb = None
    if info.emb_range is not None:
        a, b = info.emb_range
        emb = image[a:b].clone().view(torch.float32).view(info.emb_shape)  # small; an owned copy
    m = info.meta
    return KVBlock(
        item_id=m["item_id"], text=m.get("text", ""), token_ids=json.loads(m.get("token_ids", "[]")),
        start_pos=int(m.get("start_pos", "0")), kv=kv, model_fingerprint=m["model_fingerprint"],
        prefix_sha256=m.get("prefix_sha256", ""), timestamp=m.get("timestamp") or None, embedding=emb,
        extra=json.loads(m.get("extra") or "{}"), kv_dtype=info.format, kv_scale=scale,
    )


def _view(image: torch.Tensor, byte_range: tuple[int, int], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``image[a:b]``: zero-copy when aligned, else a copy."""
    raw = image[byte_range[0] : byte_range[1]]
    if raw.data_ptr() % torch.empty((), dtype=dtype).element_size() == 0:
        return raw.view(dtype).view(shape)
    return raw.clone().view(dtype).view(shape)


def open_image(data: bytes | memoryview, keyring: sealing.Keyring | None, *, tenant: str, user: str, item: str,
               source: str) -> tuple[memoryview, BlobInfo]:
    """The verified plain image of one blob file's bytes that must belong to (tenant, user, item): with a
    keyring only a blob sealed for exactly that place opens (BlobAuthError otherwise, plain blobs included);
    without one (an unsealed store) the image is checked by its sha256 alone."""
    if keyring is None:
        image = memoryview(data).cast("B")
        return image, verify(image, source=source, expect_sha=None, expect_item=item)
    image = sealing.open_blob(data, keyring, tenant=tenant, user=user, item=item, source=source)
    return image, verify(image, source=source, expect_sha=None, expect_item=item, digest=False)


def remove_orphan_temps(root: Path) -> int:
    """Delete temp files a crashed write left in the store layout (``<root>/<t>/<u>/<fp>/.<item>*.tmp``)."""
    n = 0
    for p in Path(root).glob(f"*/*/*/.*{SUFFIX}.*{TEMP_SUFFIX}"):
        try:
            p.unlink()
            n += 1
        except OSError:
            pass
    return n


def rewrap_blobs(blobs: list[tuple[str, str, Path]], keyring: sealing.Keyring, lock: threading.Lock) -> int:
    """Re-wrap the data key of each (tenant, user, path) sealed blob under the keyring's current KEK line,
    each file rewritten atomically while holding ``lock``. Returns blobs rewritten."""
    n = 0
    for tenant, _user, path in blobs:
        with lock:
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # deleted meanwhile
                continue
            new = sealing.rewrap(data, keyring, tenant=tenant, source=str(path))
            if new is not None:
                atomic_write(path, new)
                n += 1
    return n
