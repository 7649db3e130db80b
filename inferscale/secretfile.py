"""Secret files (the KEK file, the internal token, the peer secret): refused when others can read them, read whole.

One rule for every key or token the fleet reads from a file: no "other" permission bits, and group bits only for
a group this process belongs to. Kubernetes mounts a Secret volume under the pod's fsGroup and always adds group
read for it (whatever `defaultMode` says), and that group is the pod's own; a file readable by anyone else on the
machine (0644, the usual umask) is refused at start with a ConfigError naming the file and its mode.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from inferscale.errors import ConfigError


def check_private(path: str | os.PathLike, what: str) -> None:
    """ConfigError when `path` can be read or written by other users, or by a group this process is not in."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read ({e.strerror or e})") from None
    mode = stat.S_IMODE(st.st_mode)
    own_groups = {os.getgid(), os.getegid(), *os.getgroups()}
    if mode & 0o007 or mode & 0o020 or (mode & 0o040 and st.st_gid not in own_groups):
        raise ConfigError(f"{what} {path} is mode {mode:04o}, readable by other users: make it 0600 or 0400 "
                          "(chmod 600), or group-readable only by this process's own group")


def read_secret(path: str | os.PathLike, what: str) -> str:
    """The file's text without a trailing newline, after `check_private`; ConfigError when empty or unreadable."""
    check_private(path, what)
    try:
        text = Path(path).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    if not text:
        raise ConfigError(f"{what} {path} is empty")
    return text
