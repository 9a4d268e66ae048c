"""Progress lines for the long stages, written to the job's log.

``tail -f results/logs/<stage>/...`` should show a running job moving. ``Progress`` logs one line
about every tenth of the work (and at the end): items done, percent, rate and the time left at
that rate::

    rollout: 96/256 prompts (38%), 41.3 prompts/s, 4 s left

It logs nothing of its own when the work is tiny (fewer than ``min_items``), so short jobs keep
short logs. ``Clock``: where a job's seconds went, phase by phase (the train job's ``phases_s``, the
publication's parts).
"""

from __future__ import annotations

import logging
import time


class Progress:
    def __init__(
        self, log: logging.Logger, label: str, total: int, unit: str = "items", every: float = 0.1, min_items: int = 2
    ):
        self.log, self.label, self.total, self.unit = log, label, max(int(total), 0), unit
        self.step = max(1, int(self.total * every))
        self.quiet = self.total < min_items
        self.done = 0
        self.next = self.step
        self.start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        """``n`` more items are done."""
        self.done = min(self.done + n, self.total)
        if self.quiet or (self.done < self.next and self.done < self.total):
            return
        while self.next <= self.done:
            self.next += self.step
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else float("inf")
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        self.log.info(
            "%s: %d/%d %s (%.0f%%), %.3g %s/s, %s",
            self.label,
            self.done,
            self.total,
            self.unit,
            100 * self.done / max(self.total, 1),
            rate,
            self.unit,
            "done" if self.done >= self.total else f"{left:.0f} s left",
        )


class Clock:
    """Adds the seconds since its last call to ``seconds[name]``: ``clock("load")`` closes the
    phase named load (nothing is kept where ``seconds`` is None)."""

    def __init__(self, seconds: dict[str, float] | None) -> None:
        self.seconds, self.last = seconds, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        if self.seconds is not None:
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now
