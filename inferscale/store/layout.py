"""Names and paths of the disk tier (G3).

Layout: ``<root>/<tenant>/<user>/<fingerprint[:16]>/<item><kvformat.SUFFIX>`` (sealed) plus ``<root>/catalogue.sqlite``.
Every name is checked against one pattern before it touches a path, so no name can climb out of its tenant's
directory (no ``..``, no ``/``, no leading dot)."""

from __future__ import annotations

import re
from pathlib import Path

from inferscale.contract import id_problem, is_valid_id
from inferscale.errors import ConfigError
from inferscale.kvformat import SUFFIX

FINGERPRINT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,255}$")
CATALOGUE_NAME = "catalogue.sqlite"
FP_DIR_LEN = 16


def check_name(kind: str, value: object) -> str:
    """Return ``value`` when it is a valid tenant/user/item name, else raise ConfigError naming it."""
    problem = id_problem(f"{kind} name", value)
    if problem:
        raise ConfigError(f"invalid {problem}")
    return value


def check_fingerprint(value: object) -> str:
    if not isinstance(value, str) or not FINGERPRINT_RE.match(value) or ".." in value:
        raise ConfigError(f"invalid model fingerprint {value!r}")
    return value


def blob_path(root: Path, tenant: str, user: str, fingerprint: str, item: str) -> Path:
    return Path(root) / tenant / user / fingerprint[:FP_DIR_LEN] / f"{item}{SUFFIX}"


def scan_blobs(root: Path) -> list[tuple[str, str, Path]]:
    """(tenant, user, path) of every blob in the store layout (depth 4); encoding-Job output one level up
    (``<root>/<tenant>/<user>/<item><SUFFIX>``) and temp files are ignored."""
    out = []
    for path in sorted(Path(root).glob(f"*/*/*/*{SUFFIX}")):
        tenant, user = path.parts[-4], path.parts[-3]
        if path.name.startswith(".") or not is_valid_id(tenant) or not is_valid_id(user):
            continue
        out.append((tenant, user, path))
    return out
