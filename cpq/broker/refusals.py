"""A rank that refused a task before running it: what changed, and where the task goes.

A rank refuses a task, running nothing of it, when a file it loaded changed on disk since
(``cpq.rank.freshness``) or when an import read a variable whose value the task changes
(``cpq.rank.importenv``). Which of the two, the rank says in ``RankDone.stale_kind``
(feature ``refusal-kind``), a field the decoder checks against its values: the broker never
reads it from the words of ``stale``, which only name the file or the variable. A rank
without the feature (an older cpq) is taken at the safe reading: code changed, a fresh
group (bounded by :data:`MAX_STALE_BOUNCES`). A report that contradicts itself (a kind
without a subject, a refusal at start-up that is not a variable's, another rank's result)
is invalid (:class:`InvalidReport`): :class:`~cpq.broker.tasks.Tasks` ends its task as an
error naming the rank, and recycles the group.

This module decides from the report and the task's records, without sockets or time;
``Tasks`` carries the decision out. See docs/design.md "Fidelity" and "Task outcome".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cpq import protocol
from cpq.broker.model import Task
from cpq.broker.startenv import StartBound

#: Fresh groups a task may find stale in a row before it is an error (a file that changes
#: all the time, such as a module a test writes and imports, would bounce it forever).
MAX_STALE_BOUNCES = 3


class InvalidReport(ValueError):
    """A rank's report that decodes but contradicts itself: nothing in it can be trusted."""


@dataclass(frozen=True)
class Refusal:
    kind: Literal["code", "variable", "state"]
    subject: str  # the file that changed, the variable's name, or what the last caller left
    at_start: bool = False  # the variable was read while the group started

    def __str__(self) -> str:
        return f"the variable {self.subject}" if self.kind == "variable" else self.subject

    @property
    def what(self) -> str:
        return {"variable": "environment", "state": "state"}.get(self.kind, "code")


def check(
    message: protocol.RankDone, rank_no: int, features: frozenset[str] | None
) -> Refusal | None:
    """The refusal rank ``rank_no``'s report makes (None: the rank ran the task);
    ``features``: what the group's ranks read. Raises :class:`InvalidReport` for a report
    at odds with itself or with its sender (another rank's result)."""
    if message.result.rank != rank_no:
        raise InvalidReport(f"a result for rank {message.result.rank}")
    if not message.stale:
        if message.stale_kind or message.stale_start:
            raise InvalidReport("a refusal that names nothing that changed")
        return None
    if "refusal-kind" not in (features or ()):
        return Refusal("code", message.stale)  # an older rank: its words are not parsed
    if not message.stale_kind:
        raise InvalidReport(f"a refusal that does not say what {message.stale!r} is")
    if message.stale_start and message.stale_kind != "variable":
        raise InvalidReport(f"a refusal at start-up for {message.stale!r}, not a variable")
    return Refusal(message.stale_kind, message.stale, message.stale_start)


@dataclass(frozen=True)
class Decision:
    """What becomes of a refused task and its group."""

    stop_group: str  # why the group is stopped; "": it is kept (released)
    bounce: str  # non-empty: queue the task again, in front, saying this in the timeline
    error: str  # non-empty: end the task with this error
    spec: protocol.PoolSpec | None = None  # the widened spec the bounce goes to


def decide(task: Task, refusal: Refusal, world_size: int, start_bound: StartBound) -> Decision:
    """Where the task goes. Changed code or a variable read after start: the group runs
    nothing more and the task goes to a fresh group. A variable read while the group
    started: every group of the spec starts alike, so a fresh one would read the same; the
    group stays (its other tasks may agree; but one rank's refusal says nothing of its
    peers, which may be waiting in a collective for it: a group of several ranks goes), the
    spec learns the name (:mod:`cpq.broker.startenv`) and the task goes to a group started
    with the caller's value; without one, an error that says how to make it part of the spec.
    """
    if not refusal.at_start:
        stop = f"{refusal.what} changed: {refusal}"
        if refusal.kind == "state":
            stop = f"the previous caller's state: the group {refusal}"
        if task.orphaned:
            return Decision(stop, "", "cancelled: its client went away")
        if task.stale_bounces >= MAX_STALE_BOUNCES:
            error = (
                f"{refusal} keeps changing: {task.stale_bounces + 1} fresh groups in a row "
                "found it changed after loading it"
            )
            return Decision(stop, "", error)
        return Decision(stop, f"bounced: {refusal.what} changed", "")
    name = refusal.subject
    stop = "" if world_size == 1 else f"a rank refused a task: {refusal} read at start"
    start_bound.learn(task.submit.spec, name)
    widened = start_bound.widen(task.submit.spec, task.submit.env)
    if widened != task.spec and task.stale_bounces < MAX_STALE_BOUNCES and not task.orphaned:
        return Decision(stop, f"bounced: {name} read at start", "", widened)
    error = (
        f"{name} was read while cpq's group started (importing torch, cpq or CPQ_PRELOAD), "
        f"with another value than this test's: list it in CPQ_SPEC_ENV (CPQ_SPEC_ENV={name}) "
        "so its groups start with your value"
    )
    return Decision(stop, "", error)
