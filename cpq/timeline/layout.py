"""What is drawn on each track: a group's spawn, tasks and stop; clients' waits; counters.

Shared by the trace (:mod:`cpq.timeline.trace`) and the page (:mod:`cpq.timeline.html`), so
both show the same picture. Slices on one track never overlap (trace viewers require it):
a task's slice on its group ends at the latest when the group was stopped (a group that
fails takes its task with it; the task's own end, measured when its verdict was decided, is
kept in its arguments), and waits of one client that overlap (a client with several tasks
in flight) go to lanes of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from cpq.timeline.run import Attempt, GroupLife, Run

T = TypeVar("T")


@dataclass
class Slice:
    start: float
    end: float
    kind: str  # spawn | task | warm-up | stopping
    name: str
    attempt: Attempt | None = None


def group_slices(run: Run, group: GroupLife) -> list[Slice]:
    """The group's spawn (asked for -> ready), tasks, and stop (stop -> processes reaped),
    clipped to the run's window, in time order, never overlapping."""
    lo, hi = run.start, run.end
    life_end = group.end(run.end)
    out: list[Slice] = []
    ready_or_end = group.ready if group.ready is not None else (group.stop or life_end)
    spawn_name = "spawn (spare)" if group.spare else "spawn"
    if group.ready is None:
        spawn_name += ": never ready"
    out.append(Slice(group.spawn, ready_or_end, "spawn", spawn_name))
    stop_at = group.stop if group.stop is not None else float("inf")
    for a in run.attempts:
        if a.group != group.key or a.started is None:
            continue
        kind = "warm-up" if a.first else "task"
        out.append(Slice(a.started, min(a.ended, stop_at), kind, a.test, a))
    if group.stop is not None:
        out.append(Slice(group.stop, life_end, "stopping", f"stopping ({group.cause})"))
    clipped: list[Slice] = []
    last_end = lo
    for s in sorted(out, key=lambda s: s.start):
        start, end = max(s.start, lo, last_end), min(s.end, hi)
        if end < start:
            continue
        clipped.append(Slice(start, end, s.kind, s.name, s.attempt))
        last_end = end
    return clipped


def lanes(spans: list[tuple[float, float, T]]) -> list[list[tuple[float, float, T]]]:
    """Spans in as few lanes as possible with no overlap in a lane (first fit, by start)."""
    out: list[list[tuple[float, float, T]]] = []
    for span in sorted(spans, key=lambda s: (s[0], s[1])):
        for lane in out:
            if lane[-1][1] <= span[0]:
                lane.append(span)
                break
        else:
            out.append([span])
    return out


def waits(run: Run) -> dict[str, list[list[tuple[float, float, Attempt]]]]:
    """Each client's waits (queued -> started, or -> ended for a task that never ran), in
    lanes, clipped to the window."""
    per_client: dict[str, list[tuple[float, float, Attempt]]] = {}
    for a in run.attempts:
        end = a.started if a.started is not None else a.ended
        start, end = max(a.queued, run.start), min(end, run.end)
        if end >= start:
            per_client.setdefault(a.client or "(unknown client)", []).append((start, end, a))
    return {client: lanes(spans) for client, spans in sorted(per_client.items())}


def counters(run: Run) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """(queued tasks, busy ranks) over time: a point at each change within the window."""
    queued: list[tuple[float, int]] = []
    busy: list[tuple[float, int]] = []
    for a in run.attempts:
        left = a.started if a.started is not None else a.ended
        queued += [(a.queued, 1), (left, -1)]
        if a.started is not None and a.group:
            busy += [(a.started, a.ws), (a.ended, -a.ws)]
    return _steps(queued, run.start, run.end), _steps(busy, run.start, run.end)


def _steps(deltas: list[tuple[float, int]], lo: float, hi: float) -> list[tuple[float, int]]:
    level, points = 0, [(lo, 0)]
    for t, delta in sorted(deltas, key=lambda d: (d[0], d[1])):
        level += delta
        at = min(max(t, lo), hi)
        if points[-1][0] == at:
            points[-1] = (at, level)
        else:
            points.append((at, level))
    return points
