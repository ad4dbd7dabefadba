"""The retry rule (docs/design.md "Task outcome"): an infra failure is retried while the
task has attempts left, ``1 + submit.retries`` (0 retries when a rerun plugin reruns the test
itself, so attempts never multiply); the last failure is the verdict, ``error``.

Notes are one line each (they reach the test's stderr and JUnit); the detail of a failure
appears once: in the error when the retry fails too (with attempt 1's when it differs), or
after the note when the retry passes, so a flaky hang still shows where attempt 1 was.
Pure bookkeeping on the :class:`~cpq.broker.model.Task`; the queueing is the caller's.
"""

from __future__ import annotations

from cpq import protocol
from cpq.broker.model import Task
from cpq.broker.verdicts import join


def another_attempt(task: Task) -> bool:
    """Whether the task may run again after its current attempt failed."""
    return task.attempts <= task.submit.retries


def retried(task: Task, reason: str, detail: str, group_id: str) -> None:
    """Count the failed attempt and say so in the task's notes; it runs again."""
    attempt = task.attempts
    where = f" on group {group_id}" if group_id else ""
    task.attempts += 1
    note = f"attempt {attempt}{where}: {reason}; retried on a fresh group"
    task.notes.append(f"{protocol.RETRY_NOTE} {note}")
    if attempt == 1:
        task.first_failure = (reason, detail)


def final_message(task: Task, reason: str, detail: str, group_id: str) -> str:
    """The ``error`` verdict's message after the last attempt (and its closing note)."""
    attempt = task.attempts
    if attempt == 1:  # no retry allowed: the failure is the verdict, as it happened
        return join(reason, detail)
    where = f" on group {group_id}" if group_id else ""
    task.notes.append(f"{protocol.RETRY_FAIL_NOTE} attempt {attempt}{where}: {reason}")
    message = join(f"{reason} ({attempt} attempts)", detail)
    first_reason, first_detail = task.first_failure
    if first_detail and first_detail != detail:
        message += f"\nattempt 1 ({first_reason}):\n{first_detail}"
    task.first_failure = ("", "")  # said once, in the verdict
    return message
