"""Stand-in of ``tensorrt_llm/inputs/utils.py`` (tests only): ``get_cache_salt_id(cache_salt: str) -> int``, a
64-bit id of the salt string. TensorRT-LLM hashes with its own hasher; any stable 64-bit hash stands in, since
the connector only compares ids made by this same function."""

import hashlib


def get_cache_salt_id(cache_salt: str) -> int:
    return int.from_bytes(hashlib.sha256(cache_salt.encode("utf-8")).digest()[:8], "little", signed=False)
