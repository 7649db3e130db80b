"""Label values derived from object names: always valid, however long or oddly ending the name is.

A label value is at most 63 characters of `[A-Za-z0-9._-]`, beginning and ending with an alphanumeric; an object
name may be 253 characters of a DNS subdomain. Cutting a name at 63 can leave a trailing `-` or `.`, which the API
server refuses (422) on every retry, so a name that is not itself a valid label value becomes a readable prefix
plus a hash of the whole name: distinct names stay distinct, and the same name always gives the same value.
"""

from __future__ import annotations

import hashlib
import re

LABEL_VALUE_MAX = 63
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_HASH_CHARS = 10


def is_label_value(value: str) -> bool:
    return len(value) <= LABEL_VALUE_MAX and _LABEL_VALUE.match(value) is not None


def label_value(name: str) -> str:
    """`name` itself when it is a valid label value, else `<prefix>-<hash of name>` (63 characters at most)."""
    if is_label_value(name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:_HASH_CHARS]
    prefix = re.sub(r"[^-A-Za-z0-9_.]", "-", name)[:LABEL_VALUE_MAX - _HASH_CHARS - 1]
    prefix = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", prefix)
    return f"{prefix}-{digest}" if prefix else digest
