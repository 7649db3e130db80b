"""KV blob format: one file per memory item, a safetensors image, sealed at rest (``inferscale.sealing``).

Tensors:
  ``kv``        [layers, 2, kv_heads, tokens, head_dim]  keys (index 0) and values (index 1): the model dtype, or
                the compact form of ``kv_dtype`` (``inferscale.kvquant``; int4 packs two channels a byte)
  ``kv_scale``  float32, only for compact formats          the dequantization scales (shape per ``kvquant``)
  ``embedding`` [dim] float32, optional                   the retrieval embedding of the item's text
Metadata (all strings): format version, model fingerprint, the memory-prefix hash the item was encoded after,
the item's id/text/timestamp, its token ids, the first position it was encoded at, dtype, ``kv_dtype`` (absent
in blobs written before compact formats: bf16), and the sha256 of the tensor bytes (kv, kv_scale, embedding).
One contiguous ``kv`` tensor per item keeps a transfer one region.
On disk a blob is sealed (AES-GCM, bound to tenant/user/item) whenever a KEK is configured; plain images are only
for local use (``encode`` without ``--kek-file``, ``ask --blobs``). Both use ``SUFFIX``: the content says which.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from inferscale import kvquant, sealing
from inferscale.blobimage import FORMAT_VERSION, BlobInfo, parse_header, tensor_digest, view_tensor
from inferscale.contract import DEFAULT_KV_DTYPE
from inferscale.errors import BlobCorruptError, ConfigError, FingerprintMismatchError

SUFFIX = ".kvblob"  # a plain safetensors image or a sealed one (sealing.MAGIC); never write it as a literal
TEMP_SUFFIX = ".tmp"  # atomic_write's temp files: ``.<name>.<random>.tmp``, removed at store start if orphaned


@dataclass
class KVBlock:
    """The KV state of one memory item, as encoded after the shared memory prefix."""

    item_id: str
    text: str
    token_ids: list[int]
    start_pos: int  # positions it was encoded at: start_pos .. start_pos + len(token_ids) - 1
    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim]
    model_fingerprint: str
    prefix_sha256: str
    timestamp: str | None = None
    embedding: torch.Tensor | None = None
    extra: dict[str, str] = field(default_factory=dict)
    # Storage format (inferscale.kvquant): "bf16" = ``kv`` in the model's dtype; otherwise ``kv`` is compact and
    # ``kv_scale`` holds its scales. Dequantized only at injection.
    kv_dtype: str = DEFAULT_KV_DTYPE
    kv_scale: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes the block holds in a tier: compact kv plus its scales."""
        n = self.kv.numel() * self.kv.element_size()
        if self.kv_scale is not None:
            n += self.kv_scale.numel() * self.kv_scale.element_size()
        return n

    def float_kv(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The block's K/V as float [L, 2, H, N, D] (dequantized when compact; keys as encoded, unshifted)."""
        from inferscale.kvdequant import dequantize  # the injection kernel: loaded only when a block needs it

        return dequantize(self.kv, self.kv_scale, self.kv_dtype, dtype)


def compact(block: KVBlock, kv_dtype: str) -> KVBlock:
    """``block`` (float kv, as encoded: keys not shifted) stored in ``kv_dtype`` (inferscale.kvquant)."""
    kvquant.check_kv_dtype(kv_dtype)
    if block.kv_dtype != DEFAULT_KV_DTYPE:
        raise ConfigError(f"block {block.item_id!r} is already {block.kv_dtype}")
    kv, scale = kvquant.quantize(block.kv, kv_dtype)
    return dataclasses.replace(block, kv=kv, kv_scale=scale, kv_dtype=kv_dtype)


def tensor_sha256(kv: torch.Tensor, embedding: torch.Tensor | None, kv_scale: torch.Tensor | None = None) -> str:
    h = hashlib.sha256()
    h.update(_raw_bytes(kv))
    if kv_scale is not None:
        h.update(_raw_bytes(kv_scale))
    if embedding is not None:
        h.update(_raw_bytes(embedding))
    return h.hexdigest()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    # View as bytes without a dtype round-trip (bf16 has no numpy dtype).
    return memoryview(t.detach().contiguous().view(torch.uint8).numpy()).cast("B")


def encode_blob(block: KVBlock) -> bytes:
    """Serialise a block to safetensors bytes (with checksum)."""
    kv = block.kv.detach().contiguous().cpu()
    scale = None if block.kv_scale is None else block.kv_scale.detach().to(kvquant.SCALE_DTYPE).contiguous().cpu()
    kvquant.check_layout(block.kv_dtype, kv.dtype, tuple(kv.shape), None if scale is None else tuple(scale.shape),
                         source=block.item_id)
    tensors = {"kv": kv}
    if scale is not None:
        tensors["kv_scale"] = scale
    emb = None
    if block.embedding is not None:
        emb = block.embedding.detach().to(torch.float32).contiguous().cpu()
        tensors["embedding"] = emb
    meta = {
        "format": "inferscale-kv",
        "format_version": FORMAT_VERSION,
        "model_fingerprint": block.model_fingerprint,
        "prefix_sha256": block.prefix_sha256,
        "item_id": block.item_id,
        "text": block.text,
        "timestamp": block.timestamp or "",
        "token_ids": json.dumps(block.token_ids),
        "start_pos": str(block.start_pos),
        "dtype": str(kv.dtype).removeprefix("torch."),
        "kv_dtype": block.kv_dtype,
        "sha256": tensor_sha256(kv, emb, scale),
        "extra": json.dumps(block.extra),
    }
    return st_save(tensors, metadata=meta)


def decode_blob(
    data: bytes | bytearray | memoryview,
    *,
    source: str = "<bytes>",
    expect_fingerprint: str | None = None,
    expect_prefix: str | None = None,
    verify: bool = True,
) -> KVBlock:
    """Parse and verify a blob (by ``inferscale.blobimage``, the one parser); its tensors are owned copies.
    Raises BlobCorruptError / FingerprintMismatchError naming ``source``."""
    if sealing.is_sealed(data):
        raise BlobCorruptError(f"{source}: a sealed blob; only a store holding its tenant's KEK can open it")
    view = memoryview(data).cast("B")
    info = parse_header(view, source=source, total=len(view))
    if verify and tensor_digest(view, info) != info.sha256:
        raise BlobCorruptError(f"{source}: checksum mismatch (item {info.item_id!r})")
    if expect_fingerprint is not None and info.fingerprint != expect_fingerprint:
        raise FingerprintMismatchError(
            f"{source}: encoded for model {info.fingerprint[:16]}, running model is {expect_fingerprint[:16]}")
    if expect_prefix is not None and info.meta.get("prefix_sha256") != expect_prefix:
        raise FingerprintMismatchError(f"{source}: encoded after another memory prefix; re-encode it")
    try:
        block = block_from_image(torch.frombuffer(bytearray(view), dtype=torch.uint8), info)
    except (ValueError, KeyError, TypeError) as e:  # metadata the header parse does not read
        raise BlobCorruptError(f"{source}: not a readable KV blob ({e})") from None
    if block.kv.shape[3] != block.num_tokens:
        raise BlobCorruptError(f"{source}: kv shape {tuple(block.kv.shape)} does not match {block.num_tokens} tokens")
    return block


def block_from_image(image: torch.Tensor, info: BlobInfo, *, kv: torch.Tensor | None = None) -> KVBlock:
    """A KVBlock over a uint8 blob image. ``kv`` overrides the kv tensor (e.g. a GPU copy); otherwise the kv is
    a zero-copy view of ``image`` when aligned (the caller keeps the image alive), else a copy."""
    if kv is None:
        kv = view_tensor(image, info.kv_range, info.kv_dtype, info.kv_shape)
    scale = None
    if info.scale_range is not None:
        scale = view_tensor(image, info.scale_range, kvquant.SCALE_DTYPE, info.scale_shape)
    emb = None
    if info.emb_range is not None:
        a, b = info.emb_range
        emb = image[a:b].clone().view(torch.float32).view(info.emb_shape)  # small; an owned copy
    return block_from_views(info, kv, scale, emb)


def block_from_views(info: BlobInfo, kv: torch.Tensor, scale: torch.Tensor | None,
                     embedding: torch.Tensor | None) -> KVBlock:
    """The KVBlock of an image whose tensors are already viewed: its metadata from ``info``, parsed once per
    BlobInfo (a DRAM hit parses nothing). ``token_ids`` and ``extra`` are the block's own copies."""
    m = info.meta
    return KVBlock(
        item_id=m["item_id"], text=m.get("text", ""), token_ids=list(info.token_ids), start_pos=info.start_pos,
        kv=kv, model_fingerprint=m["model_fingerprint"], prefix_sha256=m.get("prefix_sha256", ""),
        timestamp=m.get("timestamp") or None, embedding=embedding, extra=dict(info.extra), kv_dtype=info.format,
        kv_scale=scale,
    )


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part, and the
    rename survives a crash (file and directory fsynced). The file is 0600: blobs hold tenants' data.

    On any error (a full disk included) the temp file is removed and the old file is untouched."""
    path = Path(path)
    tmp = stage_file(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def stage_file(path: Path, data: bytes | memoryview) -> Path:
    """``data`` in a fsynced temp file (0600) next to ``path``, for the caller to rename into place (several
    staged in parallel, then renamed, cost one directory fsync). On any error the temp file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def blob_path(directory: Path, item_id: str) -> Path:
    return Path(directory) / f"{item_id}{SUFFIX}"


def save_block(block: KVBlock, directory: Path, *, keyring: sealing.Keyring | None = None,
               tenant: str | None = None, user: str | None = None) -> Path:
    """Write ``DIR/<item><SUFFIX>``: sealed for (tenant, user) when a keyring is given, else a plain image."""
    path = blob_path(directory, block.item_id)
    image = encode_blob(block)
    if keyring is not None:
        if not tenant or not user:
            raise ConfigError("a sealed blob needs its tenant and user")
        image = sealing.seal(image, keyring, sealing.Binding(tenant, user, block.item_id, block.model_fingerprint))
    atomic_write(path, image)
    return path


def load_block(path: Path, *, expect_fingerprint: str | None = None, expect_prefix: str | None = None) -> KVBlock:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BlobCorruptError(f"{path}: cannot read ({e.strerror or e})") from None
    return decode_blob(data, source=str(path), expect_fingerprint=expect_fingerprint, expect_prefix=expect_prefix)


def list_blobs(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).glob(f"*{SUFFIX}") if not p.name.startswith("."))
