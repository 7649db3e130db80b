"""Put the TensorRT-LLM stand-in (``tests/trtllm/standin/tensorrt_llm``, named a stand-in in its docstrings) on
``sys.path`` for a while; afterwards ``import tensorrt_llm`` fails again, as it does on these machines."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

STANDIN = Path(__file__).parent / "trtllm" / "standin"


def _purge() -> None:
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        del sys.modules[name]
    sys.modules.pop("inferscale.trtllm.connector", None)  # it bound the ABCs of whichever package it found


@contextlib.contextmanager
def installed() -> Iterator[object]:
    """The stand-in package, importable as ``tensorrt_llm`` inside."""
    sys.path.insert(0, str(STANDIN))
    _purge()
    try:
        import tensorrt_llm

        yield tensorrt_llm
    finally:
        sys.path.remove(str(STANDIN))
        _purge()
