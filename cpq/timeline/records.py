"""The timeline history's format: one JSON line per event of a group's life or a task attempt.

The timing history (:mod:`cpq.timings`) says how long each test took; it cannot say where a
suite's *time* went: when a group was asked for and when it was ready, which group sat idle
holding GPUs, how long a test waited and for which group. This file beside it records what a
timeline needs, each time taken by the broker where the event happens (no time is derived
from another one): a record per group event (``broker``, ``hello``, ``spawn``, ``ready``,
``stop``, ``gone``) and one per task attempt (``task``: queued, started, ended, group,
outcome, client and pytest session). Times are wall-clock seconds since the epoch, so the
files of several hosts (the shards of a fan-out run) share one axis.

Readers skip torn or foreign lines, like the timing history's (the history is advisory; a
crash costs one torn line), and count them so that a user sees how many were skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: What each event kind carries beside ``ev`` and ``t`` (the wall time it happened), with
#: the type of each field. A task attempt carries its own times (``t`` is when it ended).
FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "broker": {"pid": (int,), "host": (str,)},
    "hello": {"client": (str,), "session": (str,)},
    "spawn": {"group": (str,), "spec": (str,), "ws": (int,), "gpus": (list,), "spare": (bool,)},
    "ready": {"group": (str,)},
    "stop": {"group": (str,), "reason": (str,), "cause": (str,)},
    "gone": {"group": (str,)},
    "task": {
        "test": (str,),
        "spec": (str,),
        "ws": (int,),
        "attempt": (int,),
        "group": (str,),
        "queued": (float, int),
        "started": (float, int, type(None)),
        "outcome": (str,),
        "client": (str,),
        "session": (str,),
        "first": (bool,),
    },
}

#: Why a group stopped, as the ``cause`` of its ``stop`` record. (A group whose broker
#: never stopped it, killed with it, gets ``broker-gone`` from the reader: ``cpq.timeline.run``.)
CAUSES = ("recycled", "failed", "evicted", "spare-unused", "shutdown")


def timeline_path(timings_path: Path) -> Path:
    """Where the timeline of a timing history lives: beside it, ``<stem>.timeline.jsonl``."""
    return timings_path.with_name(f"{timings_path.stem}.timeline.jsonl")


@dataclass
class Loaded:
    """Records read from timeline files, and how many lines were skipped as unreadable."""

    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0


def parse(line: str) -> dict[str, Any] | None:
    """One record, or None for a torn, foreign or hand-edited line."""
    line = line.strip()
    if not line:
        return None
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    fields = FIELDS.get(data.get("ev"))  # type: ignore[arg-type]
    t = data.get("t")
    if fields is None or not _finite(t):
        return None
    for name, kinds in fields.items():
        value = data.get(name)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return None
    if data["ev"] == "spawn" and not all(isinstance(g, str) for g in data["gpus"]):
        return None
    return data


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_lines(lines: Iterable[str], into: Loaded | None = None) -> Loaded:
    loaded = into or Loaded()
    for line in lines:
        if not line.strip():
            continue
        record = parse(line)
        if record is None:
            loaded.skipped += 1
        else:
            loaded.records.append(record)
    return loaded


def read(path: Path) -> Loaded:
    """Every readable record of ``path`` and its rotated predecessor, oldest first."""
    loaded = Loaded()
    for candidate in (Path(f"{path}.1"), path):
        try:
            handle = open(candidate, encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError:
            continue
        with handle:
            read_lines(handle, loaded)
    return loaded


def dumps(record: dict[str, Any]) -> str:
    """One record as its line (without the newline)."""
    return json.dumps(record, separators=(",", ":"))


def iter_lines(records: Iterable[dict[str, Any]]) -> Iterator[str]:
    for record in records:
        yield dumps(record) + "\n"
