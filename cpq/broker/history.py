"""The broker's half of the timing history: appending finished tasks, learning deadlines.

Why a file and not only the broker's memory: the history has to outlive brokers (the
embedded broker exits when idle), be readable with no broker running (``cpq-status
--timings``), and cost the event loop one small append per task. JSON lines are append-only,
so a crash or a full disk costs at most one torn line, which readers skip. The record and
its reader are :mod:`cpq.timings`.

Writing never stops the broker: on ``OSError`` (a full disk, a read-only or vanished
directory) :class:`TimingsLog` logs once, counts the failure and keeps serving; it tries
again with the next task, so the history resumes when the disk has room again.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from cpq.timings import DEFAULT_MAX_BYTES, TIMES, TaskTiming, fmt_seconds

log = logging.getLogger("cpq.timings")


class JsonLines:
    """Appends lines to ``path`` (``None``: writes nothing): the timing history's and the
    timeline's file. One ``os.write`` per call, so a crash tears at most the last line."""

    def __init__(self, path: Path | None, max_bytes: int, what: str) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.what = what
        self.errors = 0
        #: Called after this file was rotated (the timeline rotates with the timings).
        self.on_rotate: Callable[[], None] | None = None
        self._failing = False
        # After a failed write (or a crash mid-write) the file may end in a torn line; the
        # next line then starts with a newline so that only the torn one is lost.
        self._torn = path is not None and _ends_torn(path)

    def write(self, data: str) -> bool:
        """Append ``data`` (whole lines); False (logged once per failure streak) on error."""
        if self.path is None:
            return False
        raw = (("\n" if self._torn else "") + data).encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                written = os.write(fd, raw)
                if written != len(raw):
                    self._torn = True
                    raise OSError(f"short write ({written} of {len(raw)} bytes)")
                info = os.fstat(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self.errors += 1
            self._torn = True
            if not self._failing:
                self._failing = True
                log.warning(
                    "cannot write the %s %s (%s); serving on without it and retrying with "
                    "each task",
                    self.what,
                    self.path,
                    exc,
                )
            return False
        self._torn = False
        if self._failing:
            self._failing = False
            log.info("writing the %s %s works again", self.what, self.path)
        if stat.S_ISREG(info.st_mode) and info.st_size > self.max_bytes:
            self.rotate()
        return True

    def rotate(self) -> None:
        """Keep one generation: ``<file>`` becomes ``<file>.1``."""
        if self.path is None:
            return
        try:
            os.replace(self.path, f"{self.path}.1")
        except OSError as exc:
            log.warning("cannot rotate the %s %s: %s", self.what, self.path, exc)
            return
        if self.on_rotate is not None:
            self.on_rotate()


class TimingsLog(JsonLines):
    """Appends :class:`TaskTiming` lines to ``path`` (``None``: keeps no history)."""

    def __init__(self, path: Path | None, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        super().__init__(path, max_bytes, "timing history")

    def append(self, timing: TaskTiming) -> bool:
        """Write one line; False (logged once per failure streak) when it could not."""
        # vars(), not dataclasses.asdict(): the fields are scalars, and asdict deep-copies
        # each one (a third of the broker's CPU per task on a busy node).
        return self.write(json.dumps(vars(timing), sort_keys=True) + "\n")


def _ends_torn(path: Path) -> bool:
    """True when ``path`` is a non-empty regular file whose last byte is not a newline."""
    try:
        with open(path, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return False
            size = handle.seek(0, os.SEEK_END)
            if size == 0:
                return False
            handle.seek(size - 1)
            return handle.read(1) != b"\n"
    except OSError:
        return False


class History:
    """The slowest passing run per test id (or target): what learned deadlines are made of.

    Only passing runs count: a failure may have stopped early and an infra error's duration
    is the deadline's, neither says how long the test needs.
    """

    def __init__(self) -> None:
        self.slowest: dict[str, float] = {}

    def add(self, timing: TaskTiming) -> None:
        if timing.outcome != "passed":
            return
        key = timing.key
        if timing.duration_s > self.slowest.get(key, -1.0):
            self.slowest[key] = timing.duration_s

    def load(self, timings: Iterable[TaskTiming]) -> int:
        count = 0
        for timing in timings:
            self.add(timing)
            count += 1
        return count

    def deadline(self, key: str, requested: float, k: float, floor: float) -> tuple[float, str]:
        """``(seconds, note)``: ``max(floor, k * slowest)`` with history, else ``requested``.

        The note ("learned: 3 \u00d7 slowest 1.2s") is empty when nothing was learned; it goes
        into status and into the error text, so a user can see why a deadline was short.
        """
        slowest = self.slowest.get(key)
        if slowest is None:
            return requested, ""
        learned = k * slowest
        if learned >= floor:
            return learned, f"learned: {k:g} {TIMES} slowest {fmt_seconds(slowest)}s"
        return floor, f"learned: floor {floor:g}s > {k:g} {TIMES} slowest {fmt_seconds(slowest)}s"
