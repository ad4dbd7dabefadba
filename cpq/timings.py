"""The timing history's format: one JSON line per finished task (shared by broker and clients).

Why a file and not only the broker's memory: the history has to outlive brokers (the
embedded broker exits when idle), be readable with no broker running (``cpq-status
--timings``), and cost the event loop one small append per task. JSON lines are append-only,
so a crash or a full disk costs at most one torn line, which readers skip.

This module owns the record and reads it (``cpq-status --timings`` reads with no broker
running); the broker's writer and what it learns are :mod:`cpq.broker.history`; the table
is :mod:`cpq.client.render`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import MISSING, asdict, dataclass
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
    #: The project the test belongs to (the client's first import root: pytest's rootdir,
    #: or the working directory of ``cpq submit``); "" in records of older brokers.
    project: str = ""

    @property
    def key(self) -> str:
        return history_key(self.project, self.test_id, self.target)


def fmt_seconds(value: float) -> str:
    """Seconds for messages: "2", "0.37", "123" (no float noise like 0.370368)."""
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def history_key(project: str, test_id: str, target: str) -> str:
    """What a history is kept per: the project and its test id (else the target). Two
    projects with a ``test_dist.py::test_all_reduce`` each keep their own history."""
    name = test_id or target
    return f"{project}::{name}" if project else name


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
        if name not in data and spec.default is not MISSING:
            continue  # a field newer than the record: its default
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
                "test": t.test_id or t.target,
                "project": t.project,
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
    tests.sort(key=lambda e: (-(e["p95_s"] or -1.0), e["test"], e["project"]))
    slowest = sorted(timed, key=lambda t: -t.duration_s)[: max(0, top)]
    return {
        "records": records,
        "first_at": first,
        "last_at": last,
        "tests": tests,
        "slowest": [asdict(t) for t in slowest],
    }
