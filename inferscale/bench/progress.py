"""A progress bar for the long benches: tqdm on stderr, so stdout keeps only the table and JSON, and off when stderr
is not a terminal (CI logs, pipes, files get no control characters)."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def progress(*, total: int | None, desc: str, unit: str = "run", file: Any = None) -> tqdm:
    stream = file if file is not None else sys.stderr
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not _is_tty(stream), leave=False,
                dynamic_ncols=True)


def _is_tty(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
