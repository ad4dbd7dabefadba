"""Spin, then block: a wait that polls without sleeping for a moment after activity.

Why this exists (docs/design.md "Dispatch"): a no-op task's round trip crosses four
processes (client, broker, ranks, broker, client), and each of them waits for the next
message in a blocking poll. On a many-core host every such wait puts the process to sleep,
and its core drops into a deep idle state: waking it costs tens of microseconds, and the
Python that then runs does so on cold caches, several times slower than the same code
measured hot. A process that has just received or sent a message is likely to get the next
one soon (the broker's next submit, a rank's next task), so for a short window after its
last activity it polls without a timeout instead, and blocks only when the window passes
quietly. Idle processes never spin; a busy one costs at most the window's CPU per message.

It spins only where cores are plenty (:data:`MIN_CORES` usable by this process, its
cgroup's CPU quota included): on a small machine (CI's 2 cores) a spinning process would
take the core the process it waits for needs. ``CPQ_SPIN_US`` sets the window in
microseconds (0: never spin), whatever the cores: in the broker's environment for the
broker and the ranks it starts, in a caller's for that caller.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

SPIN_ENV = "CPQ_SPIN_US"
#: The window after activity, where spinning is on by default.
DEFAULT_WINDOW_S = 0.002
#: Spinning is on by default only with this many cores usable by the process.
MIN_CORES = 8


class Poller(Protocol):
    def poll(self, timeout: int | None = ...) -> Sequence[tuple[Any, int]]: ...


def default_window_s(environ: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """The window from ``CPQ_SPIN_US``, else :data:`DEFAULT_WINDOW_S` on a machine with
    :data:`MIN_CORES` usable cores or more, else 0. A value that is not a number of
    microseconds is an error: a typo must not silently change how every wait behaves."""
    given = environ.get(SPIN_ENV, "").strip()
    if given:
        try:
            window_us = int(given)
        except ValueError:
            raise ValueError(f"{SPIN_ENV}={given!r}: expected microseconds (0: no spin)") from None
        if window_us < 0:
            raise ValueError(f"{SPIN_ENV}={given!r}: expected microseconds (0: no spin)")
        return window_us / 1e6
    return DEFAULT_WINDOW_S if usable_cores() >= MIN_CORES else 0.0


def usable_cores(cgroup: str = "/sys/fs/cgroup") -> float:
    """The cores this process may use: its CPU affinity, bounded by its cgroup's CPU quota
    (a container limited to two cores on a big host sees all of the host's in its
    affinity; spinning there would spend the quota and throttle the container)."""
    try:
        cores: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    return min(cores, quota) if quota is not None else cores


def _cgroup_quota(cgroup: str) -> float | None:
    """The cgroup's CPU quota in cores (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``); None when unlimited or unreadable."""
    try:
        with open(os.path.join(cgroup, "cpu.max")) as handle:
            quota, period = handle.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(cgroup, "cpu", "cpu.cfs_quota_us")) as handle:
            quota_us = int(handle.read())
        with open(os.path.join(cgroup, "cpu", "cpu.cfs_period_us")) as handle:
            period_us = int(handle.read())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


class Spinner:
    """Polls ``poller`` without a timeout until :attr:`window_s` after the last activity
    (:meth:`note`), then blocks as asked. Only its owner says what activity is: a message
    that does not start or end a task (a heartbeat, every second from every peer) must
    not keep a process spinning."""

    def __init__(
        self, window_s: float | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.window_s = default_window_s() if window_s is None else window_s
        self.clock = clock
        self.last = -float("inf")

    def note(self) -> None:
        """Activity now: the next message is likely to come soon."""
        self.last = self.clock()

    def poll(self, poller: Poller, timeout_ms: int) -> list[tuple[Any, int]]:
        """``poller.poll(timeout_ms)``, spinning first while the window is open."""
        if self.window_s > 0 and timeout_ms != 0:
            now = self.clock()
            until = self.last + self.window_s
            if now < until:
                if timeout_ms > 0:
                    until = min(until, now + timeout_ms / 1000)
                while True:
                    events = list(poller.poll(0))
                    if events:
                        return events
                    after = self.clock()
                    if after >= until:
                        break
                if timeout_ms > 0:
                    timeout_ms = max(0, timeout_ms - int((after - now) * 1000))
        return list(poller.poll(timeout_ms))
