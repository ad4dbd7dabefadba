"""What a hung task's verdict says: whose stacks are asked for, and what they mean.

A deadline that passed asks every rank where it is (a rank stuck in a collective still
heartbeats; docs/design.md "Liveness"); a rank that failed while its peers did not finish
within ``--failure-grace`` asks the others. :class:`~cpq.broker.tasks.Tasks` sends the
requests and waits; this module decides from the task's records, without sockets or time.
"""

from __future__ import annotations

from cpq.broker.model import Task
from cpq.broker.verdicts import where
from cpq.protocol import RankError, RankResult
from cpq.timings import fmt_seconds

#: The error type of a rank still running after a peer failed (the group is stopped, as
#: torchrun's agent stops such workers with SIGTERM).
STUCK = "cpq.RankStuck"


def stack_ranks(task: Task) -> set[int]:
    """The ranks whose stacks the verdict needs: all of them after a deadline, else the
    ones that had not reported when a peer failed."""
    assert task.group is not None
    if task.stacks_reason == "deadline":
        return set(task.group.ranks)
    return set(task.group.ranks) - set(task.results)


def stacks_text(task: Task) -> str:
    return "\n".join(f"--- rank {r} ---\n{where(task, r)}" for r in sorted(stack_ranks(task)))


def deadline_passed(task: Task) -> str:
    """The reason a deadline gives, and where it found the test (the phase of the lowest
    rank that was in one); a learned deadline the run outgrew gives way to the one the
    client asked for (when longer), so a test slow today but alive is not killed twice by a
    guess. The client knows a deadline by the verdict's ``cause``, not by these words."""
    phases = task.stack_phases
    task.hung_phase = next((phases[r] for r in sorted(phases)), "")
    learned = f" ({task.deadline_note})" if task.deadline_note else ""
    reason = f"deadline of {fmt_seconds(task.timeout_s)}s{learned} passed"
    if task.deadline_note:
        task.timeout_s = max(task.timeout_s, task.requested_timeout_s)
        task.deadline_note = ""
    return reason


def mark_stuck(task: Task, failure_grace_s: float) -> tuple[str, str]:
    """Give each rank still running after a peer failed an ``error`` result carrying its
    stack; returns the verdict's message and why the group is recycled."""
    failed = sorted(r for r, res in task.results.items() if res.outcome == "failed")
    stuck = sorted(stack_ranks(task))
    for rank_no in stuck:
        stdout, stderr = task.stack_output.get(rank_no, ("", ""))
        pid = task.group.ranks[rank_no].pid if task.group and rank_no in task.group.ranks else 0
        task.results[rank_no] = RankResult(
            rank=rank_no,
            outcome="error",
            error=RankError(
                STUCK,
                f"did not finish within {failure_grace_s:g}s after rank(s) {failed} failed "
                f"(waiting in a collective?) (pid: {pid})",
                task.stacks.get(rank_no, ""),
            ),
            stdout=stdout,  # what it printed before it was stopped, as under torchrun
            stderr=stderr,
        )
    message = f"rank(s) {failed} failed; rank(s) {stuck} were stuck; the group was recycled"
    return message, f"rank(s) {stuck} stuck after a peer failed"
