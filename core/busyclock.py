"""Time during which something is in use: a counter of users and the total time it was above zero.

The rollout uses it for the generator's busy and idle time (requests in flight, episodes live) and the time env
calls were outstanding, when many episodes overlap and per-call durations would add up to more than the wall time.
Pure: the caller may pass the clock reading (tests do), else ``time.monotonic()`` is read."""

from __future__ import annotations

import time


class BusyClock:
    """``enter()`` / ``exit()`` (or ``set(n)``) move the count of users; ``total()`` is the time the count was > 0."""

    def __init__(self) -> None:
        self.count = 0
        self._since: float | None = None  # when the count last rose from 0
        self._done = 0.0  # closed busy intervals

    @staticmethod
    def _now(now: float | None) -> float:
        return time.monotonic() if now is None else now

    def set(self, count: int, now: float | None = None) -> None:
        if count < 0:
            raise ValueError(f"a BusyClock count cannot be negative (got {count}): more exit() than enter()")
        t = self._now(now)
        if self.count == 0 and count > 0:
            self._since = t
        elif self.count > 0 and count == 0:
            if t < self._since:
                raise ValueError(f"the clock went back: {t} < {self._since}")
            self._done += t - self._since
            self._since = None
        self.count = count

    def enter(self, now: float | None = None) -> None:
        self.set(self.count + 1, now)

    def exit(self, now: float | None = None) -> None:
        self.set(self.count - 1, now)

    def total(self, now: float | None = None) -> float:
        """Busy seconds so far (an open interval counts up to ``now``)."""
        if self._since is None:
            return self._done
        return self._done + max(0.0, self._now(now) - self._since)
