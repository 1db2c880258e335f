"""Rate-limited log lines: a peer that provokes a refusal a thousand times a second must not flood the log.

Every refusal is still counted in its metric; the log gets at most ``burst`` lines per ``period_s`` per key, and
the first line after a quiet spell says how many were left out. Lines left out are counted in
``kvfabric_log_lines_suppressed_total``.
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import Counter


class RateLimitedLog:
    """``log(level, key, msg, *args)`` as ``logger.log``, but at most ``burst`` lines per ``period_s`` per key."""

    def __init__(
        self, logger: logging.Logger, suppressed: Counter | None = None, *, burst: int = 5, period_s: float = 10.0
    ) -> None:
        self._logger = logger
        self._suppressed_metric = suppressed
        self._burst = burst
        self._period_s = period_s
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[float, int, int]] = {}  # key -> (window start, lines logged, left out)

    def log(self, level: int, key: str, msg: str, *args: object) -> bool:
        """Log unless over the limit; returns whether the line was written."""
        now = time.monotonic()
        with self._lock:
            start, logged, left_out = self._windows.get(key, (now, 0, 0))
            if now - start >= self._period_s:
                start, logged = now, 0
            if logged >= self._burst:
                self._windows[key] = (start, logged, left_out + 1)
                if self._suppressed_metric is not None:
                    self._suppressed_metric.inc()
                return False
            self._windows[key] = (start, logged + 1, 0)
        if left_out:
            msg += f" ({left_out} similar line(s) left out before this one)"
        self._logger.log(level, msg, *args)
        return True
