"""Interrupting a running task nobody waits for any more: its client cancelled it or left.

Holding the group until the task's deadline would keep it busy for nobody; killing it at
once would cost a spawn for every cancelled test (a Ctrl-C, a client's own timeout). So the
ranks that have not reported are asked to interrupt the task (``cpq.rank.cancel``) and given
``cancel_grace_s``: when every rank reported within it after the same number of collectives
(``RankDone.pg_seq``: none was left half-done), the group serves again; else it is recycled.
Decided here from the task's records, without sockets or time; :class:`~cpq.broker.tasks.Tasks`
sends the requests and ends the task. See docs/design.md "Task outcome".
"""

from __future__ import annotations

from cpq.broker.model import Rank, Task

#: The verdict of an interrupted task (it goes nowhere: its client cancelled or left).
CANCELLED = "cancelled: its client went away"


def begin(task: Task, until: float) -> list[Rank]:
    """Mark ``task`` abandoned; the ranks to ask to interrupt it by ``until`` (none when it
    is not running, or they were asked already). A deadline's or a failure's wait stops."""
    task.orphaned = True  # the verdict goes nowhere
    group = task.group
    if group is None or task.cancel_until is not None:
        return []
    task.cancel_until = until
    task.grace_until = task.stacks_until = None
    return [rank for rank_no, rank in group.ranks.items() if rank_no not in task.results]


def recycle_reason(task: Task, world_size: int) -> str:
    """Every rank reported after the cancel: why its group cannot serve again ("": it can)."""
    seqs = set(task.pg_seqs.values())
    if world_size == 1 or (len(seqs) == 1 and -1 not in seqs):
        return ""
    return f"interrupted mid-collective (sequence numbers {sorted(seqs)})"
