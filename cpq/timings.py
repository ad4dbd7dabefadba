"""Timing history: one JSON line per finished task, and what the broker learns from it.

Why a file and not only the broker's memory: the history has to outlive brokers (the
embedded broker exits when idle), be readable with no broker running (``cpq-status
--timings``), and cost the event loop one small append per task. JSON lines are append-only,
so a crash or a full disk costs at most one torn line, which readers skip.

Writing never stops the broker: on ``OSError`` (a full disk, a read-only or vanished
directory) :class:`TimingsLog` logs once, counts the failure and keeps serving; it tries
again with the next task, so the history resumes when the disk has room again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("cpq.timings")

TIMINGS_FILE = "timings.jsonl"
#: Past this size the log is rotated to ``<file>.1`` (one generation kept), so a broker that
#: runs for months cannot fill the disk with its history.
DEFAULT_MAX_BYTES = 64 * 2**20
#: The multiplication sign of learned-deadline notes ("learned: 3 x slowest 1.2s").
TIMES = "\u00d7"


@dataclass
class TaskTiming:
    """One finished task, as written to the history (one JSON object per line)."""

    finished_at: float  # wall clock, seconds since the epoch
    target: str
    test_id: str
    spec: str
    world_size: int
    outcome: str
    duration_s: float  # from dispatch to verdict of the last attempt, as the broker saw it
    queue_s: float  # from the first submit to the last dispatch
    attempts: int
    retries: int
    group_id: str
    deadline_s: float

    @property
    def key(self) -> str:
        return history_key(self.test_id, self.target)


def fmt_seconds(value: float) -> str:
    """Seconds for messages: "2", "0.37", "123" (no float noise like 0.370368)."""
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def history_key(test_id: str, target: str) -> str:
    """What a history is kept per: the test id when the client sent one, else the target."""
    return test_id or target


class TimingsLog:
    """Appends :class:`TaskTiming` lines to ``path`` (``None``: keeps no history)."""

    def __init__(self, path: Path | None, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.errors = 0
        self._failing = False
        # After a failed write (or a crash mid-write) the file may end in a torn line; the
        # next line then starts with a newline so that only the torn one is lost.
        self._torn = path is not None and _ends_torn(path)

    def append(self, timing: TaskTiming) -> bool:
        """Write one line; False (logged once per failure streak) when it could not."""
        if self.path is None:
            return False
        data = ("\n" if self._torn else "") + json.dumps(asdict(timing), sort_keys=True) + "\n"
        raw = data.encode()
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
                    "cannot write the timing history %s (%s); serving on without it and "
                    "retrying with each task",
                    self.path,
                    exc,
                )
            return False
        self._torn = False
        if self._failing:
            self._failing = False
            log.info("writing the timing history %s works again", self.path)
        if stat.S_ISREG(info.st_mode) and info.st_size > self.max_bytes:
            self._rotate()
        return True

    def _rotate(self) -> None:
        assert self.path is not None
        try:
            os.replace(self.path, f"{self.path}.1")
        except OSError as exc:
            log.warning("cannot rotate the timing history %s: %s", self.path, exc)


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


# --------------------------------------------------------------------------- reading


def read(path: Path) -> Iterator[TaskTiming]:
    """Every readable record of ``path`` and its rotated predecessor, oldest first.

    Torn, foreign or hand-edited lines are skipped: the history is advisory, and a reader
    that refused the whole file over one bad line would make it useless.
    """
    for candidate in (Path(f"{path}.1"), path):
        try:
            handle = open(candidate, encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError:
            continue
        with handle:
            for line in handle:
                timing = _parse(line)
                if timing is not None:
                    yield timing


_FIELDS = TaskTiming.__dataclass_fields__


def _parse(line: str) -> TaskTiming | None:
    line = line.strip()
    if not line:
        return None
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    values: dict[str, Any] = {}
    for name, spec in _FIELDS.items():
        value = data.get(name)
        kind = spec.type
        if kind == "float":
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                return None
            if not math.isfinite(value):
                return None
            value = float(value)
        elif kind == "int":
            if not isinstance(value, int) or isinstance(value, bool):
                return None
        elif not isinstance(value, str):
            return None
        values[name] = value
    return TaskTiming(**values)


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


# --------------------------------------------------------------------------- summaries


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of an ascending, non-empty list."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def summarize(timings: Iterable[TaskTiming], top: int = 10) -> dict[str, Any]:
    """Per-test p50/p95/max and the ``top`` slowest runs, as a JSON-able dict.

    Durations are those of runs that reached a verdict (passed, failed, skipped); infra
    errors are counted but not timed, because their duration is the deadline's or the
    crash's, not the test's.
    """
    per_key: dict[str, dict[str, Any]] = {}
    timed: list[TaskTiming] = []
    records = 0
    first = last = None
    for t in timings:
        records += 1
        first = t.finished_at if first is None else min(first, t.finished_at)
        last = t.finished_at if last is None else max(last, t.finished_at)
        entry = per_key.setdefault(
            t.key,
            {
                "test": t.key,
                "target": t.target,
                "spec": t.spec,
                "runs": 0,
                "passed": 0,
                "failed": 0,
                "skipped": 0,
                "errors": 0,
                "retries": 0,
                "durations": [],
                "last_outcome": "",
            },
        )
        entry["runs"] += 1
        entry["retries"] += t.retries
        entry["last_outcome"] = t.outcome
        counter = t.outcome if t.outcome in ("passed", "failed", "skipped") else "errors"
        entry[counter] += 1
        if counter != "errors":
            entry["durations"].append(t.duration_s)
            timed.append(t)
    tests = []
    for entry in per_key.values():
        durations = sorted(entry.pop("durations"))
        entry["p50_s"] = percentile(durations, 50) if durations else None
        entry["p95_s"] = percentile(durations, 95) if durations else None
        entry["max_s"] = durations[-1] if durations else None
        tests.append(entry)
    tests.sort(key=lambda e: (-(e["p95_s"] or -1.0), e["test"]))
    slowest = sorted(timed, key=lambda t: -t.duration_s)[: max(0, top)]
    return {
        "records": records,
        "first_at": first,
        "last_at": last,
        "tests": tests,
        "slowest": [asdict(t) for t in slowest],
    }


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 120:
        return f"{value:.2f}s"
    return f"{value / 60:.1f}m"


def _when(epoch: float | None) -> str:
    return "-" if epoch is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def render(summary: dict[str, Any], path: Path) -> str:
    """The ``cpq-status --timings`` screen: a per-test table, then the slowest runs."""
    from cpq.status import table

    if not summary["records"]:
        return f"no timing history in {path} (the broker writes one line per finished task)"
    tests = summary["tests"]
    lines = [
        f"timing history {path}: {summary['records']} tasks, {len(tests)} tests, "
        f"{_when(summary['first_at'])} .. {_when(summary['last_at'])}",
        "",
        table(
            ["test", "runs", "fail", "err", "retry", "p50", "p95", "max"],
            [
                [
                    e["test"],
                    e["runs"],
                    e["failed"],
                    e["errors"],
                    e["retries"],
                    _secs(e["p50_s"]),
                    _secs(e["p95_s"]),
                    _secs(e["max_s"]),
                ]
                for e in tests
            ],
        ),
    ]
    if summary["slowest"]:
        lines += [
            "",
            f"{len(summary['slowest'])} slowest runs:",
            table(
                ["duration", "test", "outcome", "spec", "queued", "group", "finished"],
                [
                    [
                        _secs(t["duration_s"]),
                        history_key(t["test_id"], t["target"]),
                        t["outcome"] + (f" (attempt {t['attempts']})" if t["retries"] else ""),
                        t["spec"],
                        _secs(t["queue_s"]),
                        t["group_id"] or "-",
                        _when(t["finished_at"]),
                    ]
                    for t in summary["slowest"]
                ],
            ),
        ]
    return "\n".join(lines)
