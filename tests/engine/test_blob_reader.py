"""One reader of the blob format (inferscale/blobimage.py): kvformat.decode_blob and the store's in-place
parse give the same block; decode_blob's tensors are its own (not views of the caller's buffer)."""

import json

import pytest
import torch

from inferscale.blobimage import parse_header
from inferscale.errors import BlobCorruptError
from inferscale.kvformat import block_from_image, compact, decode_blob, encode_blob
from store.helpers import make_block  # tests/store/helpers.py (tests/ is on sys.path)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_decode_blob_and_the_store_read_the_same_block(kv_dtype):
    b = make_block("m0")
    b = b if kv_dtype == "bf16" else compact(b, kv_dtype)
    data = bytearray(encode_blob(b))
    got = decode_blob(data)
    image = torch.frombuffer(data, dtype=torch.uint8)
    via_store = block_from_image(image, parse_header(memoryview(data), source="x", total=len(data)))
    for x in (got, via_store):
        assert x.item_id == "m0" and x.kv_dtype == kv_dtype and x.token_ids == b.token_ids
        assert torch.equal(x.kv.view(torch.uint8), b.kv.view(torch.uint8))
        assert (x.kv_scale is None) == (b.kv_scale is None)
    data[len(data) // 2] ^= 0xFF  # the caller's buffer changes; decode_blob's block does not
    assert torch.equal(got.kv.view(torch.uint8), b.kv.view(torch.uint8))
    with pytest.raises(BlobCorruptError, match="checksum"):
        decode_blob(data)


def test_decode_blob_refuses_a_token_count_unlike_the_kv():
    b = make_block("m0", tokens=4)
    b.token_ids = [1, 2, 3]
    with pytest.raises(BlobCorruptError, match="does not match 3 tokens"):
        decode_blob(encode_blob(b))
    assert json.loads(parse_header(encode_blob(b), source="x").meta["token_ids"]) == [1, 2, 3]
