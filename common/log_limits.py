"""Log lines that a caller can trigger at will, at most one per kind per interval.

A flood of refused or failing calls must not flood the log (disk, the log
pipeline, the event loop formatting tracebacks): each kind of line is written
at most once per `interval_s`, and the next one written says how many were
left out meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

DEFAULT_INTERVAL_S = 10.0


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S):
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[Hashable, float] = {}
        self._left_out: dict[Hashable, int] = {}

    def log(self, kind: Hashable, level: int, message: str, *args, exc_info=None, extra=None) -> bool:
        """Writes the line unless a line of this kind was written within the
        interval (then counts it); True when written."""
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return False
        self._last[kind] = now
        left_out = self._left_out.pop(kind, 0)
        if left_out:
            message += f" ({left_out} more of this kind not logged since the last one)"
        self.logger.log(level, message, *args, exc_info=exc_info, extra=extra)
        return True
