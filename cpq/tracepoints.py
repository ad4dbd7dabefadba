"""``CPQ_TRACE_DIR=DIR``: when each process on a task's path did what, to find where a round
trip's time goes (``tools/trace_dispatch.py``; BENCHMARKS.md).

Profilers mislead here: a no-op's path is ~15 short steps in four processes, each woken from
a poll, and cProfile's per-call cost and a hot microbenchmark's warm caches both distort
them several times over. So each process notes ``(task id, step, time.perf_counter())`` at
fixed points (the client's submit and verdict, the broker's receipt, dispatch, reports and
verdict, a rank's arrival, checks, run and report), a clock every process on one host
shares, and appends them as JSON lines to ``DIR/<pid>.jsonl`` every 200 notes and at exit.
Off (the variable unset), a note costs one test of a module global. A rank sees the
variable only as a start variable (``CPQ_SPEC_ENV=CPQ_TRACE_DIR``), which the tool sets.
"""

from __future__ import annotations

import atexit
import json
import os
import time

DIR = os.environ.get("CPQ_TRACE_DIR", "")
_notes: list[tuple[str, str, float]] = []


def mark(task_id: str, step: str, at: float | None = None) -> None:
    """Note that this process reached ``step`` of ``task_id`` now (or at ``at``)."""
    if not DIR:
        return
    _notes.append((task_id, step, time.perf_counter() if at is None else at))
    if len(_notes) >= 200:
        flush()


def now() -> float:
    """The clock of :func:`mark`, for a step noted once its task id is known."""
    return time.perf_counter() if DIR else 0.0


def flush() -> None:
    """Append the notes so far to this process's file. A folder that cannot be written
    turns the notes off: tracing must never fail the task it watches."""
    global DIR
    if not DIR or not _notes:
        return
    batch = _notes[: len(_notes)]  # another thread may note meanwhile: only these go
    del _notes[: len(batch)]
    try:
        with open(os.path.join(DIR, f"{os.getpid()}.jsonl"), "a") as handle:
            handle.write(json.dumps(batch) + "\n")
    except OSError:
        DIR = ""


atexit.register(flush)
