"""What the broker records for timelines: each group's life and each task's attempts.

The record format and its readers are :mod:`cpq.timeline.records`; the pictures made of it
are :mod:`cpq.timeline.trace` and :mod:`cpq.timeline.html`. Every time is the wall clock
read where the event happens (a group asked for, ready, stopped, reaped; a task queued,
dispatched, ended), never derived from another time ("measure, don't infer").

Why buffered: the dispatch path is the broker's hot path (``tools/bench_core.py``). An event
costs a small dict and a list append where it happens; the JSON encoding and one
``os.write`` for all events since the last one happen in :meth:`Timeline.flush`, which the
broker calls once per tick (50 ms) and when it closes. A broker killed with ``SIGKILL``
loses at most one tick of events. The file sits beside the timing history
(:func:`~cpq.timeline.records.timeline_path`) and is rotated with it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from cpq.broker.clock import Clock
from cpq.broker.history import JsonLines
from cpq.broker.model import Client, Group, Task
from cpq.timeline.records import dumps

#: Past this many unwritten events (a disk that keeps failing), the oldest are dropped.
MAX_PENDING = 100_000


class Timeline:
    """Collects timeline events and appends them to ``path`` (``None``: records nothing)."""

    def __init__(self, path: Path | None, max_bytes: int, clock: Clock) -> None:
        self.file = JsonLines(path, max_bytes, "timeline")
        self.clock = clock
        self.enabled = path is not None
        self.pending: list[dict[str, Any]] = []
        self.dropped = 0
        self._event("broker", pid=os.getpid(), host=socket.gethostname())

    def _event(self, ev: str, **fields: Any) -> None:
        if self.enabled:
            self.pending.append({"ev": ev, "t": self.clock.time(), **fields})

    # ---- clients and groups

    def hello(self, client: Client) -> None:
        """A client said who it is: its name for the timeline and its pytest session."""
        info = client.info
        name = str(info.get("name") or "client")
        worker = info.get("xdist_worker")
        client.timeline_name = f"{name} {worker}" if worker else name
        pid = info.get("pid")
        if isinstance(pid, int):
            client.timeline_name += f" (pid {pid})"
        session = info.get("session")
        client.session = session if isinstance(session, str) else ""
        self._event("hello", client=client.timeline_name, session=client.session)

    def spawn(self, group: Group) -> None:
        self._event(
            "spawn",
            group=group.id,
            spec=group.spec.label(),
            ws=group.spec.world_size,
            gpus=list(group.process.gpus),
            spare=group.spare,
        )

    def ready(self, group: Group) -> None:
        self._event("ready", group=group.id)

    def stop(self, group: Group, reason: str, cause: str) -> None:
        self._event("stop", group=group.id, reason=reason, cause=cause)

    def gone(self, group: Group) -> None:
        """Its processes are reaped: its GPUs are free again."""
        self._event("gone", group=group.id)

    # ---- tasks

    def queued(self, task: Task) -> None:
        """The task (or its retry) joins a queue now."""
        task.queued_wall = self.clock.time()
        task.started_wall = 0.0

    def started(self, task: Task, group: Group) -> None:
        task.started_wall = self.clock.time()
        task.first_on_group = group.tasks_done == 0

    def attempt(self, task: Task, outcome: str, group_id: str) -> None:
        """An attempt is over: its verdict, a retry, or a bounce to a fresh group (each
        attempt is recorded once: the task's next record needs a new :meth:`queued`)."""
        if not self.enabled or not task.queued_wall:
            return
        submit = task.submit
        self.pending.append(
            {
                "ev": "task",
                "t": self.clock.time(),
                "test": submit.test_id or submit.target,
                "spec": task.spec.label(),
                "ws": task.spec.world_size,
                "attempt": task.attempts,
                "group": group_id if task.started_wall else "",
                "queued": task.queued_wall,
                "started": task.started_wall or None,
                "outcome": outcome,
                "client": task.client_name,
                "session": task.session,
                "first": task.first_on_group,
            }
        )
        task.queued_wall = 0.0  # recorded: the next record of this task is a new attempt

    # ---- writing

    def flush(self) -> None:
        """Append what was recorded since the last flush (one write); kept on failure."""
        if not self.pending:
            return
        if self.file.write("".join(dumps(record) + "\n" for record in self.pending)):
            self.pending.clear()
        elif len(self.pending) > MAX_PENDING:
            self.dropped += len(self.pending) - MAX_PENDING
            del self.pending[:-MAX_PENDING]
