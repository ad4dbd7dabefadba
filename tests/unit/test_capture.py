"""A rank's output capture (``cpq.rank.capture.FdCapture``), reused task after task: each
task gets what it wrote to fds 1 and 2 and nothing else: not the last task's output, not
what a process the last task left behind wrote between tasks; a task that prints nothing
gets empty strings."""

from __future__ import annotations

import os

from cpq.rank.capture import FdCapture


def write(fd: int, text: str) -> None:
    os.write(fd, text.encode())


def test_each_task_gets_its_own_output_and_only_its_own() -> None:
    capture = FdCapture(limit=1000)
    with capture:
        write(1, "one out\n")
        write(2, "one err\n")
    assert (capture.stdout, capture.stderr) == ("one out\n", "one err\n")
    with capture:
        pass
    assert (capture.stdout, capture.stderr) == ("", "")
    with capture:
        write(1, "three\n")
    assert (capture.stdout, capture.stderr) == ("three\n", "")


def test_what_a_leftover_process_writes_between_tasks_is_not_the_next_tasks() -> None:
    capture = FdCapture(limit=1000)
    with capture:
        # a child the task started keeps fd 1 open through a description of its own
        leftover = os.open("/proc/self/fd/1", os.O_WRONLY | os.O_APPEND)  # prints nothing
    write(leftover, "written after the task ended\n")
    os.close(leftover)
    with capture:
        write(1, "task two\n")
    assert capture.stdout == "task two\n"


def test_a_huge_output_keeps_its_head_and_tail() -> None:
    capture = FdCapture(limit=100)
    with capture:
        write(1, "H" * 60 + "M" * 500 + "T" * 60)
    head, _, tail = capture.stdout.partition("... [cpq: ")
    assert head.startswith("H" * 50) and tail.endswith("T" * 50)
    assert "bytes of output truncated" in capture.stdout
