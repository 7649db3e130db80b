"""Where InferScale keeps what it derives on this machine (dequantized models, built kernels): one rule."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$INFERSCALE_CACHE_DIR``, else ``$XDG_CACHE_HOME/inferscale``, else ``~/.cache/inferscale``."""
    base = os.environ.get("INFERSCALE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inferscale"
    )
    return Path(base)
