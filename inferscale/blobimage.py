"""The one reader of KV blob images (the format: ``inferscale.kvformat``): the safetensors header parsed in place
from raw bytes (a DRAM arena slot, a file header, a peer's write), tensors as views of the image. The store
moves whole images between tiers, so one byte range per item travels and its checksum can be verified wherever
the bytes land; ``kvformat.decode_blob`` reads a blob through the same parser."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from inferscale import kvquant
from inferscale.contract import DEFAULT_KV_DTYPE
from inferscale.errors import BlobCorruptError

FORMAT_VERSION = "1"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
}
MAX_HEADER = 64 << 20  # a header larger than this is garbage, not a KV blob
# numpy dtypes of each tensor dtype's width: a slot is shaped in numpy (cheaper per call than torch's view ops),
# then handed to torch and reinterpreted where numpy has no such dtype (bf16, fp8).
_NP_WIDTH = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


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
            extra = self.extra
        except ValueError:
            return ()
        context = extra.get("context", "") if isinstance(extra, dict) else ""
        return tuple(i for i in str(context).split(",") if i)

    # Parsed once per image: a DRAM entry keeps its BlobInfo, so a hit re-reads none of its JSON metadata.
    @cached_property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(json.loads(self.meta.get("token_ids", "[]")))

    @cached_property
    def extra(self) -> dict[str, str]:
        return json.loads(self.meta.get("extra") or "{}")

    @cached_property
    def start_pos(self) -> int:
        return int(self.meta.get("start_pos", "0"))


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


def tensor_digest(image: memoryview, info: BlobInfo) -> str:
    """sha256 of the tensor bytes (kv, kv_scale, embedding), as ``kvformat.tensor_sha256`` computes it."""
    h = hashlib.sha256()
    h.update(image[info.kv_range[0] : info.kv_range[1]])  # hashlib drops the GIL on large buffers
    if info.scale_range is not None:
        h.update(image[info.scale_range[0] : info.scale_range[1]])
    if info.emb_range is not None:
        h.update(image[info.emb_range[0] : info.emb_range[1]])
    return h.hexdigest()


def view_tensor(image: torch.Tensor, byte_range: tuple[int, int], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``image[a:b]``: zero-copy when aligned, else a copy."""
    raw = image[byte_range[0] : byte_range[1]]
    if raw.data_ptr() % dtype.itemsize == 0:
        return raw.view(dtype).view(shape)
    return raw.clone().view(dtype).view(shape)


def shaped_array(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The uint8 array ``raw`` as ``shape`` elements of ``dtype``'s width: zero-copy when aligned, else a copy.
    Shaped in numpy: cheaper per call than torch's view ops, on a path that runs once per block served."""
    arr = raw.view(_NP_WIDTH[dtype.itemsize])
    if not arr.flags.aligned:  # numpy allows unaligned arrays; torch views need aligned ones
        arr = raw.copy().view(arr.dtype)  # numpy allocations are aligned
    return arr.reshape(shape)


def array_tensor(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` tensor over ``arr`` (from ``shaped_array``) that holds ``arr`` itself, so a finalizer on
    ``arr`` runs only once the tensor and every view of it are gone (numpy views would collapse to the root)."""
    t = torch.from_numpy(arr)
    return t if t.dtype == dtype else t.view(dtype)
