"""The one rule for an encoding Job's output directory named by a caller (pull's ``source.dir``, purge's
``source_dir``, a peer's ``dir``): it must be ``<kv host path>/<tenant>/<user>`` of the request.

Standard library only (no torch): the server's internal API and the store's peer service both import it."""

from __future__ import annotations

import os
from pathlib import Path

from inferscale.errors import UnsafePathError


def job_dir_path(root: str | os.PathLike | None, tenant: str, user: str, given: str, *,
                 param: str = "source_dir") -> Path:
    """The directory ``given`` names, resolved; UnsafePathError (naming ``param``) unless it is
    ``<root>/<tenant>/<user>``: absolute, no empty/``.``/``..`` components, exactly two levels below ``root``
    once symlinks are resolved, and ending in the request's tenant and user both as given and as resolved.

    A path that resolves correctly can still be swapped for a symlink afterwards: the importer opens it with
    O_NOFOLLOW (inferscale/store/jobdir.py), so this check is the first of two, not the only one."""
    def bad(why: str) -> UnsafePathError:
        return UnsafePathError(f"{param} {given!r}: {why}", param=param)

    if root is None:
        raise bad("this node has no KV host path (INFERSCALE_KV_HOST_PATH), so no job directory is accepted")
    if not isinstance(given, str) or "\x00" in given:
        raise bad("must be a path")
    raw = given.rstrip("/")
    parts = raw.split("/")
    if given.startswith("/") and not raw:  # "/" itself: absolute and normal, just not the job's directory
        raise bad(f"must end in /{tenant}/{user}")
    if not raw.startswith("/") or any(p in ("", ".", "..") for p in parts[1:]):
        raise bad("must be an absolute, normalized path")
    if tuple(parts[-2:]) != (tenant, user):
        raise bad(f"must end in /{tenant}/{user}")
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(raw))
    if real.parent.parent != real_root or real.parts[-2:] != (tenant, user):
        raise bad(f"must be <{root}>/{tenant}/{user} (INFERSCALE_KV_HOST_PATH)")
    return real
