"""The startup heap kept out of Python's cyclic garbage collector while a server runs.

A loaded server holds ~530k objects that live as long as it does (the model's modules and parameters, the
tokenizer's and the embedder's tables, the app's routes). A full collection walks them all with the GIL held:
269 ms measured on the 2-core CPU with Gemma-3-270M loaded (``gc.collect()`` in a serving process), a stop of
every tenant's requests, the engine's steps and the admission answers. Python starts one once the objects that
survived the younger generations reach a quarter of the old one (at startup 12 of them, 20-380 ms each, while the
model, embedder and store loaded); while serving, a growing store index, the tenants' telemetry or any other
long-lived growth of ~130k objects brings the next. ``gc.freeze()`` moves the startup heap to the permanent
generation, which collections skip: the same full collection then takes 1.2 ms (8k objects walked). Objects made
later are collected as before and reference counting still frees frozen ones; only a reference cycle among
startup objects that dies while the app serves waits for shutdown, when the heap is unfrozen (several apps in one
process, as in tests, unfreeze when the last one stops). vLLM's engine core freezes its startup heap the same way.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_serving = 0  # apps inside ``startup_heap_frozen``; the heap is unfrozen when the last one leaves


@contextlib.contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """While the block runs, every object alive at its start (after a full collection) is left out of collections."""
    global _serving
    with _lock:
        gc.collect()
        gc.freeze()
        _serving += 1
    try:
        yield
    finally:
        with _lock:
            _serving -= 1
            if _serving == 0:
                gc.unfreeze()
