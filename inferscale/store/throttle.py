"""A slow disk on demand: a token-bucket reader for ``KVStore.disk_reader``, so a test or a benchmark can make the
disk tier slower than recomputing (the fetch planner's break-even, inferscale/store/fetcher.py) with real reads of
the real blob files, not a fake planner input. A stand-in for a slow or contended device; not used in serving."""

from __future__ import annotations

import threading
import time

from inferscale.errors import ConfigError
from inferscale.store.diskload import pread_into

CHUNK = 64 << 10  # bytes read per bucket draw: the rate holds within one blob, not only across blobs


class ThrottledReader:
    """Reads at most ``bytes_per_s`` on average (bursts up to ``burst`` bytes), shared by every thread using it."""

    def __init__(self, bytes_per_s: float, burst: int = CHUNK) -> None:
        if not bytes_per_s > 0 or burst <= 0:
            raise ConfigError(f"throttle: {bytes_per_s} bytes/s and a burst of {burst} bytes must be positive")
        self.rate, self.burst = float(bytes_per_s), burst
        self._tokens, self._last = float(burst), time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, fd: int, view: memoryview) -> None:
        for start in range(0, len(view), CHUNK):
            part = view[start : start + CHUNK]
            self._take(len(part))
            pread_into(fd, part, start)

    def _take(self, n: int) -> None:
        with self._lock:  # one bucket: concurrent readers share the rate, as on one device
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait:
            time.sleep(wait)
