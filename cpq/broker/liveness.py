"""Telling a silent peer that is busy from one that is dead.

While a peer is busy its heartbeats come from a second thread, which needs the GIL. A main
thread that holds the GIL in native code for seconds (a long C call, loading a big
extension, a pytest session importing a heavy test module) silences a healthy peer, and
``liveness x heartbeat`` of silence would have it declared dead: a rank's group killed
under a passing test, a client's queued tasks dropped.

The broker shares a node with its ranks (and usually with its clients), so it can look at
a silent peer's process: a main thread whose CPU time grows is computing, and the peer is
alive. A stopped (SIGSTOP), deadlocked, blocked or dead peer burns no CPU and is declared
dead on time, as ``docs/design.md``'s liveness rule says; what bounds a busy rank is its task's
deadline. The watch starts only once a peer has been quiet for a while, so a healthy node
pays nothing for it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("cpq.broker")

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def main_thread_cpu_s(pid: int) -> float | None:
    """CPU seconds used by ``pid``'s main thread; None if it is gone, stopped or a zombie.

    Read from ``/proc/<pid>/task/<pid>/stat`` (one small file) rather than through
    psutil's per-thread listing: it runs every broker tick while a peer is quiet.
    """
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the command name may contain spaces
    if len(fields) < 13 or fields[0] in ("T", "t", "Z", "X"):
        return None
    user_ticks, system_ticks = int(fields[11]), int(fields[12])
    return (user_ticks + system_ticks) / _CLOCK_TICKS


@dataclass
class BusyWatch:
    """One peer's quiet spell: is its main thread still making progress?"""

    cpu_mark: float | None = None  # main-thread CPU seconds at the last look
    computing_seen: float = 0.0  # when they last grew
    busy: bool = False  # this quiet spell was excused as busy at least once

    def quiet_for(
        self, now: float, last_seen: float, pid: int | None, watch_after_s: float
    ) -> float:
        """Seconds without a sign of life: no message since ``last_seen`` and, once the peer
        has been quiet for ``watch_after_s``, no CPU progress of process ``pid``'s main
        thread (``None``: nothing to watch, silence alone counts)."""
        if now - last_seen <= watch_after_s:
            self.cpu_mark, self.busy = None, False  # heard from: the next spell starts afresh
            return now - last_seen
        if pid is not None:
            cpu = main_thread_cpu_s(pid)
            if cpu is not None and self.cpu_mark is not None and cpu > self.cpu_mark:
                self.computing_seen, self.busy = now, True
            self.cpu_mark = cpu
        return now - max(last_seen, self.computing_seen)


def check(
    watch: BusyWatch, now: float, last_seen: float, pid: int | None, heartbeat_s: float
) -> tuple[float, bool]:
    """``(quiet seconds, just excused as busy)`` for one peer at ``now``.

    ``pid`` is the process to watch for CPU progress once the peer is quiet, or None for
    silence alone; the second value is True on the look that first finds it computing
    (the broker counts and logs those as ``busy_silences``).
    """
    was_busy = watch.busy
    quiet = watch.quiet_for(now, last_seen, pid, heartbeat_s * 1.5)
    return quiet, watch.busy and not was_busy


def quiet_for(
    watch: BusyWatch,
    now: float,
    last_seen: float,
    pid: int | None,
    heartbeat_s: float,
    who: Callable[[], str],
) -> tuple[float, bool]:
    """:func:`check`, logging the first look that finds the quiet peer ``who()`` computing
    (the caller counts it in ``busy_silences``; the label is built only then, not per tick)."""
    quiet, excused = check(watch, now, last_seen, pid, heartbeat_s)
    if excused:
        log.warning(
            "%s silent for %.1fs but computing (holding the GIL in native code?): busy, not dead",
            who(),
            now - last_seen,
        )
    return quiet, excused
