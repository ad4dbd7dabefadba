"""The deadline of a test that the ranks' pytest runs (feature ``rank-pytest``).

Such a task starts with the rank building its pytest session (plugins, conftests,
collection), which pytest-timeout in a fresh run does not count: that build gets the start
allowance a group's spawn gets, and the test's own deadline runs from its protocol's start
(``RankBegun``). A rank's second ``RankBegun`` says its protocol ended and the caller's
session finishes; once every rank is there, the finish gets the start allowance too, as a
fresh run's is not timed either. Decided here from the task's records, without sockets;
:class:`~cpq.broker.tasks.Tasks` applies it. See docs/design.md "Liveness".
"""

from __future__ import annotations

from cpq.broker.model import Task
from cpq.protocol import PYTEST_ITEM_TARGET


def first_deadline(task: Task, now: float, start_timeout_s: float) -> float:
    """The deadline of an attempt dispatched ``now``: the task's time, and for a test the
    ranks' pytest runs, the build's allowance before it."""
    building = task.submit.target == PYTEST_ITEM_TARGET
    return now + task.timeout_s + (start_timeout_s if building else 0)


def rank_begun(task: Task, rank_no: int, world_size: int, now: float, start: float) -> None:
    """Rank ``rank_no`` began the test's protocol, or (a second time) ended it; the task's
    deadline moves accordingly (``start``: the start allowance, seconds)."""
    if rank_no in task.begun_ranks:  # its protocol ended: the session's finish
        task.ended_ranks.add(rank_no)
        if len(task.ended_ranks) == world_size:  # none is in the test now
            task.deadline = max(task.deadline, now + start)
        return
    # The first rank to begin ends the build's allowance; a later one may only extend it.
    end = now + task.timeout_s
    task.deadline = max(task.deadline, end) if task.begun_ranks else end
    task.begun_ranks.add(rank_no)
