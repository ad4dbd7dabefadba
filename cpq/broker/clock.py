"""The broker's one source of time, injectable so unit tests can drive it by hand."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds for intervals and deadlines."""
        ...

    def time(self) -> float:
        """Wall-clock seconds since the epoch, for what is shown or written down."""
        ...


class SystemClock:
    """The real clocks of :mod:`time`."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to (:meth:`advance`)."""

    def __init__(self, start: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self.now = start
        self._wall_offset = wall - start

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now + self._wall_offset

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now
