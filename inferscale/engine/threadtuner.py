"""Picks torch's thread count from the decode passes it times (the rule: ``inferscale/engine/threads.py``).

Every ``every`` decode passes it runs one pass with the other count, at the batch size of the passes before it;
when that pass is faster than the median of the last ones by ``WIN`` it becomes the count, else the tuner goes
back and probes half as often (down to one pass in ``MAX_EVERY``), so a count that keeps losing costs almost
nothing. No torch: the loop hands it the function that sets the count; tests hand it a recorder.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

PROBE_EVERY = 16  # decode passes between two probes, after a switch
MAX_EVERY = 512
WIN = 0.9  # a probe must beat the current count's recent median by 10 % (one noisy pass does not flip it)
RECENT = 5  # passes at the current count whose median a probe is compared with


class ThreadTuner:
    def __init__(self, choices: tuple[int, ...], set_threads: Callable[[int], None]) -> None:
        self.choices, self._set = choices, set_threads
        self.current = choices[-1] if choices else 0
        self.every = self._countdown = PROBE_EVERY
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._batch = 0  # the batch size of the recent passes
        self._probing = 0  # the count the pass now running uses, when it is a probe

    @property
    def active(self) -> bool:
        return len(self.choices) > 1

    def before_decode(self, batch: int) -> None:
        """Called before a decode pass of ``batch`` rows: may make it a probe."""
        if not self.active or self._countdown > 0 or batch != self._batch or len(self._recent) < RECENT:
            return
        self._probing = next(c for c in self.choices if c != self.current)
        self._set(self._probing)

    def after_decode(self, batch: int, seconds: float) -> None:
        """The pass just run took ``seconds``."""
        if not self.active:
            return
        if self._probing:
            probe, self._probing = self._probing, 0
            if seconds < WIN * statistics.median(self._recent):
                self.current, self.every = probe, PROBE_EVERY
                self._recent.clear()
                self._recent.append(seconds)
            else:
                self._set(self.current)
                self.every = min(2 * self.every, MAX_EVERY)
            self._countdown = self.every
            return
        if batch != self._batch:
            self._batch = batch
            self._recent.clear()
        self._recent.append(seconds)
        self._countdown -= 1
