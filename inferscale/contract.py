"""The rules the engine, the store, the server, the operator and the CRD share, defined once here.

Standard library only (no torch, no pydantic): the operator image imports it too. docs/interfaces.md states the
same rules in prose; ``crds/usermemory.yaml`` carries ``ID_PATTERN`` and a CEL rule for ``..`` (a test keeps the
CRD and this module equal).
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal, get_args

from inferscale.errors import InvalidInputError

# A user or memory-item id. It becomes a directory or file name on every node, so it must never climb out of its
# directory: a leading letter/digit, no '/', and no '..' anywhere. Matched with fullmatch (a trailing newline is
# not accepted). ID_PATTERN is the same rule minus the '..' check, for JSON Schema/CRD/OpenAPI patterns (RE2 and
# ECMA '$' is end of text); CRDs add the CEL rule ID_CEL_RULE for the '..'.
ID_MAX_LEN = 128
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
ID_CEL_RULE = "!self.contains('..')"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

# A tenant is a Kubernetes namespace name (RFC 1123 label).
TENANT_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_TENANT_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

Mode = Literal["text", "kv", "kv-recompute", "none"]
MODES: tuple[str, ...] = get_args(Mode)
DEFAULT_MODE: Mode = "kv"
# What serves questions (``inferscale serve --engine``, INFERSCALE_ENGINE, chart value ``engine``;
# inferscale/engine/backend.py): the project's PyTorch loop, or TensorRT-LLM with the InferScale connector.
EngineName = Literal["pytorch", "trtllm"]
ENGINES: tuple[str, ...] = get_args(EngineName)
DEFAULT_ENGINE: EngineName = "pytorch"
# kv-recompute: the fraction of memory tokens re-run with the question (README, "kv-recompute").
DEFAULT_RECOMPUTE_RATIO = 0.15
# Each memory is encoded behind up to CONTEXT_ITEMS items before it, whole items within CONTEXT_TOKENS tokens.
# The operator's item hash covers the same CONTEXT_ITEMS predecessors.
CONTEXT_ITEMS = 10
CONTEXT_TOKENS = 256
# How memory KV is stored and moved (``--kv-dtype``, ``INFERSCALE_KV_DTYPE``; inferscale/kvquant.py). "bf16" is the
# uncompressed format: the model's own dtype (bf16 on GPUs); the others are compact and dequantized at injection.
KVDtype = Literal["bf16", "int8", "fp8", "int4"]
KV_DTYPES: tuple[str, ...] = get_args(KVDtype)
DEFAULT_KV_DTYPE: KVDtype = "bf16"


def is_valid_id(value: object) -> bool:
    """True when ``value`` is a valid user or item id (see ``ID_PATTERN``; no '..')."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None and ".." not in value


def id_problem(kind: str, value: object) -> str | None:
    """None when ``value`` is a valid id, else one line naming ``kind`` and what is wrong with it."""
    if is_valid_id(value):
        return None
    return f"{kind} {value!r} must match {ID_PATTERN} and must not contain '..'"


def is_valid_tenant(value: object) -> bool:
    return isinstance(value, str) and _TENANT_RE.fullmatch(value) is not None

# The tenant API reports TTFT (the x-inferscale-ttft-ms header, the response's inferscale.ttft_ms) rounded up to
# this many ms: a tenant learns its own latency, not a finer clock on other tenants' load than its own timing.
TTFT_GRANULARITY_MS = 10

# The OpenAI ``user`` field (a free string: gateways put e-mails, account ids, ...) names the memory owner. It maps
# to a store user id by one injective rule: a valid id is kept as it is unless it has the reserved shape
# ``u-<32 lowercase hex>``; every other string (and a reserved-shape one) becomes ``u-<sha256(utf-8)[:32 hex]>``.
# Kept ids never have the reserved shape and hashed ids always do, so two different strings never share an id
# (short of a 128-bit SHA-256 prefix collision). The memories API path applies the same rule.
USER_MAX_LEN = 256
USER_HASH_PREFIX = "u-"
_HASHED_USER_RE = re.compile(r"u-[0-9a-f]{32}")


def user_store_id(user: str) -> str:
    """The store user id for an API ``user`` string (1..USER_MAX_LEN characters; see the rule above)."""
    if not isinstance(user, str) or not 0 < len(user) <= USER_MAX_LEN:
        raise InvalidInputError(f"user must be a string of 1 to {USER_MAX_LEN} characters", param="user")
    if is_valid_id(user) and _HASHED_USER_RE.fullmatch(user) is None:
        return user
    return USER_HASH_PREFIX + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:32]
