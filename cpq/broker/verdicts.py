"""Where a task's verdict goes: the outcome table, the client, the totals, the history.

Kept apart from the task lifecycle (:mod:`cpq.broker.tasks`), which decides *when* a task
is over; this module decides what its verdict says and where it is written: the outcome
table (:func:`verdict`), the result sent to the client (without the fields an older client
could not decode), the totals, and the timing history that ``--adaptive-timeout`` learns
deadlines from. See ``docs/design.md``, "Task outcome".
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cpq import protocol, tracepoints
from cpq.broker.clock import Clock
from cpq.broker.config import BrokerConfig
from cpq.broker.history import History, TimingsLog
from cpq.broker.model import Client, Task, Totals
from cpq.broker.timeline import Timeline
from cpq.protocol import RankResult, TaskResult
from cpq.timings import TaskTiming, history_key, read

log = logging.getLogger("cpq.broker")


class Verdicts:
    """Sends verdicts and keeps the timing history they feed."""

    def __init__(
        self,
        config: BrokerConfig,
        clock: Clock,
        totals: Totals,
        clients: dict[bytes, Client],
        send_client: Callable[[bytes, protocol.Message | bytes], None],
        timeline: Timeline | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.totals = totals
        self.clients = clients
        self.send_client = send_client
        self.timings = TimingsLog(config.timings_file, config.timings_max_bytes)
        self.timeline = timeline or Timeline(None, 0, clock)
        self.timings.on_rotate = self.timeline.file.rotate  # one generation of each, together
        self.history = History()
        if config.adaptive_timeout and config.timings_file is not None:
            loaded = self.history.load(read(config.timings_file))
            log.info(
                "learned deadlines from %d finished tasks (%d tests) in %s",
                loaded,
                len(self.history.slowest),
                config.timings_file,
            )

    def deadline_for(self, message: protocol.Submit, requested: float) -> tuple[float, str]:
        """The task's deadline: learned from history with --adaptive-timeout, else requested.

        A learned deadline catches a hang after a few times the test's known worst case
        instead of after the suite-wide default, which is sized for the slowest test.
        """
        if not self.config.adaptive_timeout:
            return requested, ""
        key = history_key(project_of(message.spec), message.test_id, message.target)
        if key not in self.history.slowest:  # records of older brokers name no project
            key = history_key("", message.test_id, message.target)
        return self.history.deadline(
            key,
            requested,
            self.config.adaptive_k,
            self.config.adaptive_floor_s,
        )

    def send(
        self,
        task: Task,
        outcome: protocol.Outcome,
        message: str = "",
        ranks: list[RankResult] | None = None,
        cause: protocol.Cause = "",
    ) -> None:
        """Count the verdict, record it in the history, send it to the task's client."""
        now = self.clock.monotonic()
        client = self.clients.get(task.client)
        if client is not None:
            client.in_flight.discard(task.key)
        counter = outcome if outcome in ("passed", "failed", "skipped") else "errors"
        setattr(self.totals, counter, getattr(self.totals, counter) + 1)
        notes = list(task.notes)
        first_detail = task.first_failure[1]
        if notes and first_detail:  # the retry reached a verdict: show where attempt 1 was
            notes[0] += f"\n{first_detail}"
        result = TaskResult(
            task_id=task.submit.task_id,
            outcome=outcome,
            ranks=ranks or [],
            notes=notes,
            groups=list(task.groups),
            message=message,
            group_id=task.group.id if task.group else "",
            attempts=task.attempts,
            duration_s=(now - task.started_at) if task.started_at else 0.0,
            queue_s=(task.started_at or now) - task.first_queued_at,
            deadline_s=task.timeout_s,
            spawn_wait_s=round(task.spawn_wait_s, 4) if task.spawn_wait_s is not None else None,
            debug_rank=task.debug_rank,
            coverage=[task.coverage[r] for r in sorted(task.coverage)],
            phase=task.hung_phase,
            cause=cause,
            on_fresh_group=bool(task.started_at) and task.first_on_group,
        )
        ran = task.started_at or task.attempts > 1  # not: rejected, cancelled while queued
        timing = self.timing(task, result) if ran else None  # the outcome before any encoding
        if not task.orphaned and client is not None:
            features = client.features()
            try:
                frame = protocol.encode_for(protocol.Done(result), features)
            except protocol.EncodeError as exc:
                # everything that can grow goes: the verdict must reach its client
                result.ranks, result.coverage, result.notes = [], [], result.notes[:8]
                result.outcome = "error"
                result.message = f"result could not be encoded (coverage dropped): {exc}"[:4000]
                frame = protocol.encode_for(protocol.Done(result), features)
            tracepoints.mark(task.submit.task_id, "broker sends the verdict")
            self.send_client(task.client, frame)
        # After the send: the client waits for the verdict, not for the history's disk write.
        # A test whose deadline passed is FAILED in pytest (pytest-timeout's failure, or
        # cpq's error in the call phase): the timeline colours it as pytest reports it.
        shown = "failed" if cause == "deadline" else outcome
        self.timeline.attempt(task, shown, task.last_group_id)
        if timing is not None:
            self.record(timing)

    def timing(self, task: Task, result: TaskResult) -> TaskTiming:
        """The task's line in the timing history."""
        return TaskTiming(
            finished_at=self.clock.time(),
            target=task.submit.target,
            test_id=task.submit.test_id,
            spec=task.spec.label(),
            world_size=task.spec.world_size,
            outcome=result.outcome,
            duration_s=result.duration_s,
            queue_s=result.queue_s,
            attempts=task.attempts,
            retries=task.attempts - 1,
            group_id=task.last_group_id,
            deadline_s=task.timeout_s,
            project=project_of(task.spec),
        )

    def record(self, timing: TaskTiming) -> None:
        """Append a finished task to the timing history and learn from it; never raises."""
        self.history.add(timing)
        self.timings.append(timing)
        self.totals.timings_write_errors = self.timings.errors


def project_of(spec: protocol.PoolSpec) -> str:
    """Which project a task belongs to, for its timing history: the client's first root."""
    return spec.roots[0] if spec.roots else ""


def join(reason: str, detail: str) -> str:
    """A one-line reason and its detail, as a verdict's message says them."""
    return f"{reason}\n{detail}" if detail else reason


def where(task: Task, rank_no: int) -> str:
    """Where a rank was when its task's deadline passed (or a peer failed), for the report."""
    if rank_no in task.stacks:
        return task.stacks[rank_no].rstrip("\n")
    if rank_no in task.results:
        return f"(its part was done: {task.results[rank_no].outcome})"
    return "(no answer: the rank is not responding)"


def verdict(results: list[RankResult], world_size: int) -> tuple[protocol.Outcome, str]:
    """The outcome table: every rank's report → the task's outcome and message.

    Fail closed (docs/design.md "Task outcome"): a task passes only when every one of its
    ``world_size`` ranks reported ``passed``. A real failure wins over everything (it is the
    user's verdict; ranks stuck after it are reported as ``error`` by the broker); then an
    outcome the table does not know, a rank that did not report, or a rank's ``error`` make
    the task an ``error`` — never a pass.
    """
    outcomes = {r.outcome for r in results}
    if "failed" in outcomes:
        return "failed", ""
    unknown = sorted(outcomes - set(protocol.OUTCOMES))
    if unknown:
        ranks = [r.rank for r in results if r.outcome in unknown]
        return "error", f"rank(s) {ranks} reported an unknown outcome {unknown}"
    reported = sorted(r.rank for r in results)
    if reported != list(range(world_size)):
        return "error", f"ranks {reported} reported, a ws={world_size} task needs every rank once"
    if "error" in outcomes:
        errors = [r for r in results if r.outcome == "error"]
        why = "; ".join(
            f"rank {r.rank}: {r.error.type}: {r.error.message}" if r.error else f"rank {r.rank}"
            for r in errors
        )
        return "error", f"rank(s) {[r.rank for r in errors]} reported an error ({why})"
    if outcomes == {"skipped"}:
        return "skipped", results[0].error.message if results[0].error else ""
    if "skipped" in outcomes:
        skipped = [r.rank for r in results if r.outcome == "skipped"]
        return "failed", (
            f"rank(s) {skipped} skipped while the others ran; a skip must be taken on every "
            "rank (call pytest.skip before any rank-dependent branch)"
        )
    return "passed", ""  # every rank reported once, and each of them "passed"
