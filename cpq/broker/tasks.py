"""The task lifecycle: admit, queue, dispatch, collect, decide, retry once, finish, record.

A task's life: queued → running on one idle group of its spec (the same ``run`` frame goes
to every rank) → per-rank reports are collected → one verdict goes back to the client. The
ways a task can end are ``docs/design.md``'s outcome table; infra errors (deadline, a dead
or silent rank, a group that would not start) are retried once on a fresh group
(:meth:`Tasks.retry_once`, the one place that rule is written).

Tasks never touch pools: what should happen to a group after its task (release it, stop
it) is asked for in :attr:`Tasks.group_requests`, which the loop carries out.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from cpq import protocol
from cpq.broker.clock import Clock
from cpq.broker.config import BrokerConfig
from cpq.broker.history import History, TimingsLog
from cpq.broker.model import Client, Group, Task, Totals, task_key
from cpq.broker.scheduler import Queues, Resources
from cpq.protocol import RankError, RankResult, TaskResult
from cpq.timings import TaskTiming, fmt_seconds, history_key, read

log = logging.getLogger("cpq.broker")


@dataclass
class GroupRequest:
    """What the lifecycle wants done with a group whose task ended."""

    group: Group
    stop_reason: str = ""  # "": release it (the task ended cleanly); else stop it, saying why


class Tasks:
    """Every task in flight (queued or running), by :attr:`~cpq.broker.model.Task.key`."""

    def __init__(
        self,
        config: BrokerConfig,
        clock: Clock,
        totals: Totals,
        clients: dict[bytes, Client],
        resources: Resources,
        send_client: Callable[[bytes, protocol.Message], None],
        send_rank: Callable[[bytes, bytes], bool],
    ) -> None:
        self.config = config
        self.clock = clock
        self.totals = totals
        self.clients = clients
        self.resources = resources
        self.send_client = send_client
        self.send_rank = send_rank
        self.tasks: dict[str, Task] = {}
        self.queues: Queues[Task] = Queues()
        self.group_requests: list[GroupRequest] = []
        self.draining = False
        self._interpreters: set[str] = set()  # interpreters seen to be executable
        self.timings = TimingsLog(config.timings_file, config.timings_max_bytes)
        self.history = History()
        if config.adaptive_timeout and config.timings_file is not None:
            loaded = self.history.load(read(config.timings_file))
            log.info(
                "learned deadlines from %d finished tasks (%d tests) in %s",
                loaded,
                len(self.history.slowest),
                config.timings_file,
            )

    # ---- admission

    def submit(self, client: Client, message: protocol.Submit) -> None:
        self.totals.submitted += 1
        client.submitted += 1
        reason = self.reject_reason(message)
        requested = message.timeout or self.config.default_timeout_s
        timeout_s, deadline_note = self.deadline_for(message, requested)
        now = self.clock.monotonic()
        task = Task(
            client=client.identity,
            submit=message,
            spec=message.spec,
            timeout_s=timeout_s,
            queued_at=now,
            first_queued_at=now,
            requested_timeout_s=requested,
            deadline_note=deadline_note,
        )
        if task.key in self.tasks:
            reason = f"task id {message.task_id!r} is already in flight for this client"
        if reason:
            self.totals.rejected += 1
            log.info("rejected %s: %s", message.target, reason)
            self.finish(task, "error", message=f"rejected: {reason}")
            return
        self.tasks[task.key] = task
        client.in_flight.add(task.key)
        self.queues.push(task)

    def deadline_for(self, message: protocol.Submit, requested: float) -> tuple[float, str]:
        """The task's deadline: learned from history with --adaptive-timeout, else requested.

        A learned deadline catches a hang after a few times the test's known worst case
        instead of after the suite-wide default, which is sized for the slowest test.
        """
        if not self.config.adaptive_timeout:
            return requested, ""
        return self.history.deadline(
            history_key(message.test_id, message.target),
            requested,
            self.config.adaptive_k,
            self.config.adaptive_floor_s,
        )

    def reject_reason(self, message: protocol.Submit) -> str:
        if self.draining:
            return "the broker is draining and accepts no new tasks"
        module, sep, attr = message.target.partition(":")
        if not sep or not module or not attr:
            return f"target {message.target!r} must look like 'package.module:function'"
        if message.timeout is not None and not 0 < message.timeout < math.inf:
            # NaN and inf too: a deadline that never fires lets one hung test hold a group
            # (and its GPUs) for good; heartbeats only catch dead ranks, not stuck ones.
            return f"timeout must be a positive, finite number of seconds, got {message.timeout}"
        impossible = self.resources.impossible(message.spec)
        if impossible:
            return impossible
        python = message.spec.python
        if python not in self._interpreters:  # a syscall per new interpreter, not per task
            if not (os.path.isabs(python) and os.access(python, os.X_OK)):
                return f"interpreter {python!r} is not an executable on this node"
            self._interpreters.add(python)  # one removed later fails its group's start
        return ""

    def cancel(self, client: Client, task_id: str) -> None:
        task = self.tasks.get(task_key(client.identity, task_id))
        if task is None:
            return
        if task.group is None:
            self.queues.remove(lambda t: t is task)
            self.finish(task, "error", message="cancelled by the client")
        else:
            task.orphaned = True  # let it finish; the result goes nowhere

    def drop_client(self, client: Client) -> int:
        """The client is gone: its queued tasks are dropped, its running ones orphaned."""
        dropped = self.queues.remove(lambda t: t.client == client.identity)
        for task in dropped:
            self.tasks.pop(task.key, None)
        for key in client.in_flight:
            task = self.tasks.get(key)
            if task is not None:
                task.orphaned = True
        return len(dropped)

    # ---- running

    def start(self, task: Task, group: Group) -> str:
        """Send ``task`` to every rank of ``group`` (already assigned to it); "" when sent,
        else why a rank could not be reached (the group has failed)."""
        now = self.clock.monotonic()
        task.group = group
        task.last_group_id = group.id
        task.started_at = now
        task.deadline = now + task.timeout_s
        task.results.clear()
        run = protocol.RunTask(
            task_id=task.submit.task_id,
            target=task.submit.target,
            kwargs=task.submit.kwargs,
            seed=task.submit.seed,
            test_id=task.submit.test_id,
        )
        frame = protocol.encode(run)
        for rank in group.ranks.values():
            if not self.send_rank(rank.identity, frame):
                return f"rank {rank.rank} is unreachable"
        return ""

    def rank_done(self, group: Group, rank_no: int, message: protocol.RankDone) -> None:
        task = group.task
        if task is None or task.submit.task_id != message.task_id or group.state != "busy":
            return  # a late report for a task already decided
        result = message.result
        result.rank = rank_no
        task.results[rank_no] = result
        if len(task.results) == group.spec.world_size:
            self.complete(task)
        elif result.outcome == "failed" and task.grace_until is None:
            task.grace_until = self.clock.monotonic() + self.config.failure_grace_s

    def rank_stacks(self, group: Group, rank_no: int, message: protocol.RankStacks) -> None:
        task = group.task
        if task is None or task.submit.task_id != message.task_id or task.stacks_until is None:
            return
        task.stacks[rank_no] = message.stacks
        if set(task.stacks) >= self._stack_ranks(task):
            self._stacks_collected(task)

    def tick(self, now: float) -> None:
        """Deadlines, the grace after a peer failed, and the wait for stacks."""
        for task in list(self.tasks.values()):
            group = task.group
            if group is None or group.task is not task:
                continue
            if task.stacks_until is not None:
                if now >= task.stacks_until:
                    self._stacks_collected(task)
            elif now >= task.deadline:
                self._collect_stacks(task, "deadline")
            elif task.grace_until is not None and now >= task.grace_until:
                self._collect_stacks(task, "peer_failed")

    # ---- verdicts

    def complete(self, task: Task) -> None:
        """Every rank reported: aggregate per ``docs/design.md``'s outcome table."""
        group = task.group
        assert group is not None
        results = [task.results[r] for r in sorted(task.results)]
        outcome, message = verdict(results)
        self.finish(task, outcome, message=message, ranks=results)  # the verdict goes first
        self.group_requests.append(GroupRequest(group))

    def _stack_ranks(self, task: Task) -> set[int]:
        assert task.group is not None
        if task.stacks_reason == "deadline":
            return set(task.group.ranks)
        return set(task.group.ranks) - set(task.results)

    def _collect_stacks(self, task: Task, reason: str) -> None:
        assert task.group is not None
        task.stacks_reason = reason
        task.stacks_until = self.clock.monotonic() + self.config.stack_wait_s
        frame = protocol.encode(protocol.DumpStacks(task_id=task.submit.task_id))
        for rank_no in self._stack_ranks(task):
            self.send_rank(task.group.ranks[rank_no].identity, frame)

    def _stacks_collected(self, task: Task) -> None:
        group = task.group
        assert group is not None
        task.stacks_until = None
        stacks = "\n".join(
            f"--- rank {r} ---\n{task.stacks.get(r, '(no answer: the rank is not responding)')}"
            for r in sorted(self._stack_ranks(task))
        )
        if task.stacks_reason == "deadline":
            learned = f" ({task.deadline_note})" if task.deadline_note else ""
            reason = f"deadline of {fmt_seconds(task.timeout_s)}s{learned} passed"
            self.group_requests.append(GroupRequest(group, reason))
            if task.deadline_note:
                # A learned deadline is an estimate and this run outgrew it: the retry gets
                # the deadline the client asked for (when longer), so a test that is slow
                # today but alive is not killed twice by a guess.
                task.timeout_s = max(task.timeout_s, task.requested_timeout_s)
                task.deadline_note = ""
            self.infra_error(task, f"{reason}; where each rank was:\n{stacks}")
            return
        failed = sorted(r for r, res in task.results.items() if res.outcome == "failed")
        stuck = sorted(self._stack_ranks(task))
        for rank_no in stuck:
            task.results[rank_no] = RankResult(
                rank=rank_no,
                outcome="error",
                error=RankError(
                    "cpq.RankStuck",
                    f"did not finish within {self.config.failure_grace_s:g}s after rank(s) "
                    f"{failed} failed (waiting in a collective?)",
                    task.stacks.get(rank_no, ""),
                ),
            )
        self.group_requests.append(
            GroupRequest(group, f"rank(s) {stuck} stuck after a peer failed")
        )
        self.finish(
            task,
            "failed",
            message=f"rank(s) {failed} failed; rank(s) {stuck} were stuck; the group was recycled",
            ranks=[task.results[r] for r in sorted(task.results)],
        )

    def infra_error(self, task: Task, detail: str) -> None:
        """An infrastructure failure of a running task: retry once, then ``error``.

        ``detail``'s first line is the reason; the rest (rank stacks, say) goes into the
        retry note too, so a retry that passes still shows where attempt 1 hung.
        """
        task.group = None
        task.results.clear()
        task.grace_until = task.stacks_until = None
        task.stacks.clear()
        if task.orphaned:
            self.finish(task, "error", message=detail)
            return
        self.retry_once(task, detail, front=True)

    def start_failed(self, spec: protocol.PoolSpec, reason: str, log_tail: str) -> None:
        """No group of ``spec`` came up (and none is left to try): its queued tasks get one
        more try, then an error carrying the end of the group's log."""
        detail = f"{reason}\n--- end of the group's log ---\n{log_tail}"
        for task in self.queues.remove(lambda t: t.spec == spec):
            self.retry_once(task, detail, note=reason)

    def retry_once(self, task: Task, detail: str, note: str = "", front: bool = False) -> None:
        """The retry rule: a task's first infra failure queues it again (``front``: ahead of
        its client's other tasks) with a note saying why; the second is its verdict,
        ``error`` with ``detail``. ``note`` (default: ``detail``) is what the note says."""
        reason = detail.splitlines()[0]
        if task.attempts == 1:
            task.attempts = 2
            task.notes.append(
                f"{protocol.RETRY_NOTE} attempt 1: {note or detail}\n(retried on a fresh group)"
            )
            self.totals.retries += 1
            log.info("retrying %s: %s", task.submit.target, reason)
            task.queued_at = self.clock.monotonic()
            self.queues.push(task, front=front)
        else:
            task.notes.append(f"{protocol.RETRY_FAIL_NOTE} attempt 2: {reason}")
            self.finish(task, "error", message=detail)

    def stop_all(self, why: str) -> None:
        for task in list(self.tasks.values()):
            self.finish(task, "error", message=f"the broker stopped: {why}")

    def finish(
        self,
        task: Task,
        outcome: str,
        message: str = "",
        ranks: list[RankResult] | None = None,
    ) -> None:
        now = self.clock.monotonic()
        self.tasks.pop(task.key, None)
        client = self.clients.get(task.client)
        if client is not None:
            client.in_flight.discard(task.key)
        counter = outcome if outcome in ("passed", "failed", "skipped") else "errors"
        setattr(self.totals, counter, getattr(self.totals, counter) + 1)
        result = TaskResult(
            task_id=task.submit.task_id,
            outcome=outcome,
            ranks=ranks or [],
            notes=task.notes,
            message=message,
            group_id=task.group.id if task.group else "",
            attempts=task.attempts,
            duration_s=(now - task.started_at) if task.started_at else 0.0,
            queue_s=(task.started_at or now) - task.first_queued_at,
            deadline_s=task.timeout_s,
        )
        if task.started_at or task.attempts > 1:  # it ran, or tried to (not: rejected, cancelled)
            self.record(task, result)
        if not task.orphaned and client is not None:
            try:
                self.send_client(task.client, protocol.Done(result))
            except protocol.EncodeError as exc:
                result.ranks = []
                result.outcome, result.message = "error", f"result could not be encoded: {exc}"
                self.send_client(task.client, protocol.Done(result))

    def record(self, task: Task, result: TaskResult) -> None:
        """Append the task to the timing history and learn from it; never raises."""
        timing = TaskTiming(
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
        )
        self.history.add(timing)
        self.timings.append(timing)
        self.totals.timings_write_errors = self.timings.errors

    def take_group_requests(self) -> list[GroupRequest]:
        requests, self.group_requests = self.group_requests, []
        return requests


def verdict(results: list[RankResult]) -> tuple[str, str]:
    """The outcome table: every rank's report → the task's outcome and message."""
    outcomes = {r.outcome for r in results}
    if "failed" in outcomes:
        return "failed", ""
    if outcomes == {"skipped"}:
        return "skipped", results[0].error.message if results[0].error else ""
    if "skipped" in outcomes:
        skipped = [r.rank for r in results if r.outcome == "skipped"]
        return "failed", (
            f"rank(s) {skipped} skipped while the others ran; a skip must be taken on every "
            "rank (call pytest.skip before any rank-dependent branch)"
        )
    return "passed", ""
