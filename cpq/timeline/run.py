"""Timeline records -> a run: each group's life and each task attempt, within a window.

Pure functions over records (:mod:`cpq.timeline.records`), shared by the trace-event JSON
(:mod:`cpq.timeline.trace`) and the HTML page (:mod:`cpq.timeline.html`). Nothing here reads
a clock or a file: the same records always give the same picture.

A group is known by its broker's place in the file (each broker writes a ``broker`` record
when it starts) and its id: ids of older brokers restarted with each broker (``g1`` again),
a broker now ends them with its own tag. A broker killed with ``SIGKILL`` wrote no ``stop``
for its groups; they died with it, so the next ``broker`` record ends them, at the last
event their broker recorded (the last moment it is known to have run: measured, not the
next broker's start, which may come days later), with the cause :data:`BROKER_GONE`. They
are never carried into the next broker's session as idle groups.

A window (one pytest session, or a time range) keeps every group and every task that
overlaps it, whatever session they belong to: a group that served another session at the
same time was not idle, and the picture must say so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: The cause of a group whose broker ended without stopping it (killed, or crashed).
BROKER_GONE = "broker-gone"


class WindowError(ValueError):
    """The asked-for window holds nothing (no such session, an empty time range)."""


@dataclass
class GroupLife:
    key: str  # unique within a run: "<broker>:<group id>"
    id: str
    spec: str
    ws: int
    gpus: list[str]
    spare: bool
    spawn: float
    ready: float | None = None
    stop: float | None = None
    reason: str = ""
    cause: str = ""
    gone: float | None = None

    @property
    def label(self) -> str:
        where = f"GPUs {','.join(self.gpus)}" if self.gpus else "CPU"
        return f"{self.id} {self.spec} · {where}"

    def end(self, run_end: float) -> float:
        """When it stopped holding its resources (the run's end while still alive)."""
        for t in (self.gone, self.stop):
            if t is not None:
                return t
        return run_end


@dataclass
class Attempt:
    test: str
    spec: str
    ws: int
    attempt: int
    group: str  # GroupLife.key, "" when it never started
    queued: float
    started: float | None
    ended: float
    outcome: str
    client: str
    session: str
    first: bool  # the first task on its group: the group's warm-up is in it

    @property
    def wait_s(self) -> float:
        return (self.started if self.started is not None else self.ended) - self.queued

    @property
    def run_s(self) -> float:
        return self.ended - self.started if self.started is not None else 0.0


@dataclass
class Run:
    """One history (one node, one shard) within a window."""

    source: str
    start: float
    end: float
    groups: list[GroupLife] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    hellos: list[tuple[float, str, str]] = field(default_factory=list)  # t, client, session
    skipped: int = 0  # unreadable lines of the files it came from

    def group(self, key: str) -> GroupLife | None:
        for group in self.groups:
            if group.key == key:
                return group
        return None


def build(records: Iterable[dict[str, Any]], source: str = "", skipped: int = 0) -> Run:
    """Every group and attempt of ``records`` (in file order), over their whole span."""
    broker = 0
    groups: dict[str, GroupLife] = {}
    attempts: list[Attempt] = []
    hellos: list[tuple[float, str, str]] = []
    times: list[float] = []
    last_t = 0.0  # the current broker's last event
    for r in records:
        ev, t = r["ev"], float(r["t"])
        times.append(t)
        if ev == "broker":
            _broker_gone(groups.values(), f"{broker}:", last_t)
            broker += 1
            continue
        last_t = t
        if ev == "hello":
            hellos.append((t, r["client"], r["session"]))
            continue
        if ev == "task":
            key = f"{broker}:{r['group']}" if r["group"] else ""
            started = r["started"]
            attempts.append(
                Attempt(
                    test=r["test"],
                    spec=r["spec"],
                    ws=r["ws"],
                    attempt=r["attempt"],
                    group=key if key in groups else "",
                    queued=float(r["queued"]),
                    started=float(started) if started is not None else None,
                    ended=t,
                    outcome=r["outcome"],
                    client=r["client"],
                    session=r["session"],
                    first=r["first"],
                )
            )
            times.append(float(r["queued"]))
            continue
        key = f"{broker}:{r['group']}"
        if ev == "spawn":
            groups[key] = GroupLife(
                key, r["group"], r["spec"], r["ws"], list(r["gpus"]), r["spare"], spawn=t
            )
            continue
        group = groups.get(key)
        if group is None:
            continue  # its spawn was rotated away
        if ev == "ready":
            group.ready = t
        elif ev == "stop" and group.stop is None:
            group.stop, group.reason, group.cause = t, r["reason"], r["cause"]
        elif ev == "gone":
            group.gone = t
    run = Run(source, min(times, default=0.0), max(times, default=0.0), skipped=skipped)
    run.groups = sorted(groups.values(), key=lambda g: (g.spawn, g.key))
    run.attempts = sorted(attempts, key=lambda a: (a.queued, a.ended))
    run.hellos = hellos
    return run


def _broker_gone(groups: Iterable[GroupLife], prefix: str, last_t: float) -> None:
    """A new broker started: the previous broker's groups that it never stopped end at its
    last event (their processes die with their broker)."""
    for group in groups:
        if group.key.startswith(prefix) and group.stop is None and group.gone is None:
            group.stop = max(last_t, group.ready or group.spawn)
            group.cause = BROKER_GONE
            group.reason = "its broker ended without stopping it (killed?)"


def last_session(run: Run) -> str:
    """The pytest session of the most recent task that names one."""
    for attempt in sorted(run.attempts, key=lambda a: a.ended, reverse=True):
        if attempt.session:
            return attempt.session
    raise WindowError("no task in the history names a pytest session")


def session_span(run: Run, session: str) -> tuple[float, float]:
    """From the first hello of the session's clients (its warm-up asks for groups right
    after) to the end of its last task."""
    mine = [a for a in run.attempts if a.session == session]
    if not mine:
        raise WindowError(f"no task of pytest session {session!r} in the history")
    hellos = [t for t, _, s in run.hellos if s == session]
    start = min([a.queued for a in mine] + hellos)
    return start, max(a.ended for a in mine)


def window(run: Run, start: float | None = None, end: float | None = None) -> Run:
    """The part of ``run`` that overlaps ``[start, end]`` (None: unbounded)."""
    lo = run.start if start is None else max(start, run.start)
    hi = run.end if end is None else min(end, run.end)
    if hi < lo:
        raise WindowError("the time range holds nothing of the history")
    kept = Run(run.source, lo, hi, skipped=run.skipped)
    kept.groups = [g for g in run.groups if g.spawn <= hi and g.end(run.end) >= lo]
    keys = {g.key for g in kept.groups}
    kept.attempts = [
        a
        for a in run.attempts
        if a.queued <= hi and a.ended >= lo and (not a.group or a.group in keys)
    ]
    kept.hellos = [h for h in run.hellos if lo <= h[0] <= hi]
    return kept
