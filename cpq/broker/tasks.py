"""The task lifecycle: admit, queue, dispatch, collect, decide, retry once, finish, record.

A task's life: queued → running on one idle group of its spec (the same ``run`` frame goes
to every rank) → per-rank reports are collected → one verdict goes back to the client. The
ways a task can end are ``docs/design.md``'s outcome table; infra errors (deadline, a dead
or silent rank, a group that would not start) are retried once on a fresh group
(:meth:`Tasks.retry_once`, the one place that rule is written). A rank's report the broker
cannot read ends its task at once (:meth:`Tasks.unreadable`).

Policies with rules of their own are decided apart, from the task's records: what a hang's
verdict says (:mod:`cpq.broker.hangs`), where a refused task goes
(:mod:`cpq.broker.refusals`), whether an interrupted task's group serves again
(:mod:`cpq.broker.interrupts`), the retry bookkeeping (:mod:`cpq.broker.retries`).

Tasks never touch pools: what should happen to a group after its task (release it, stop
it) is asked for in :attr:`Tasks.group_requests`, which the loop carries out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from cpq import protocol, tracepoints
from cpq.broker import begun, hangs, interrupts, refusals, retries
from cpq.broker.clock import Clock
from cpq.broker.config import BrokerConfig
from cpq.broker.debugging import DebugSessions
from cpq.broker.model import Client, Group, Task, Totals, task_key
from cpq.broker.placement.admission import Admission
from cpq.broker.placement.view import Room
from cpq.broker.queues import Queues
from cpq.broker.startenv import StartBound
from cpq.broker.timeline import Timeline
from cpq.broker.verdicts import Verdicts, join, verdict
from cpq.protocol import RankResult

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
        room: Room,
        send_client: Callable[[bytes, protocol.Message | bytes], None],
        send_rank: Callable[[bytes, bytes], bool],
        timeline: Timeline | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.totals = totals
        self.clients = clients
        self.send_client = send_client
        self.send_rank = send_rank
        self.tasks: dict[str, Task] = {}
        self.queues: Queues[Task] = Queues()
        self.group_requests: list[GroupRequest] = []
        self.draining = False
        self.admission = Admission(room)
        self.start_bound = StartBound()
        self.timeline = timeline or Timeline(None, 0, clock)
        self.verdicts = Verdicts(config, clock, totals, clients, send_client, self.timeline)
        self.debug = DebugSessions(
            clients,
            send_client,
            send_rank,
            lambda group, why: self.group_requests.append(GroupRequest(group, why)),
        )

    # ---- admission

    def submit(self, client: Client, message: protocol.Submit) -> None:
        self.totals.submitted += 1
        client.submitted += 1
        reason = self.admission.reject_reason(message, self.draining)
        requested = message.timeout or self.config.default_timeout_s
        timeout_s, deadline_note = self.verdicts.deadline_for(message, requested)
        now = self.clock.monotonic()
        task = Task(
            client=client.identity,
            submit=message,
            spec=self.start_bound.widen(message.spec, message.env),
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
        task.client_name, task.session = client.timeline_name, client.session
        self.timeline.queued(task)
        self.queues.push(task)

    def cancel(self, client: Client, task_id: str) -> None:
        task = self.tasks.get(task_key(client.identity, task_id))
        if task is None:
            return
        if task.group is None:
            self.queues.remove(lambda t: t is task)
            self.finish(task, "error", message="cancelled by the client")
        else:
            self.interrupt(task, "cancelled by the client")

    def drop_client(self, client: Client) -> int:
        """The client is gone: its queued tasks are dropped, its running ones interrupted."""
        self.debug.drop_client(client)
        dropped = self.queues.remove(lambda t: t.client == client.identity)
        for task in dropped:
            self.tasks.pop(task.key, None)
            self.timeline.attempt(task, "dropped: its client went away", "")
        for key in list(client.in_flight):
            running = self.tasks.get(key)
            if running is not None and running.group is not None:
                self.interrupt(running, "its client went away")
        return len(dropped)

    def interrupt(self, task: Task, why: str) -> None:
        """Stop a running task nobody waits for any more (:mod:`cpq.broker.interrupts`)."""
        ranks = interrupts.begin(task, self.clock.monotonic() + self.config.cancel_grace_s)
        if ranks:
            log.info("interrupting %s: %s", task.submit.target, why)
            frame = protocol.encode(protocol.CancelTask(task_id=task.submit.task_id))
            for rank in ranks:
                self.send_rank(rank.identity, frame)

    # ---- running

    def start(self, task: Task, group: Group) -> str:
        """Send ``task`` to every rank of ``group`` (already assigned to it); "" when sent,
        else why a rank could not be reached (the group has failed).

        Also measures the attempt's spawn wait: a group that became ready after the attempt
        was queued is one the task waited for (started for it, by a warm-up or as a spare:
        groups of one spec are interchangeable), so the seconds from the queueing to that
        readiness are the spawn wait; a group already ready when it was queued costs 0.
        """
        now = self.clock.monotonic()
        task.spawn_wait_s = max(0.0, group.ready_at - task.queued_at)
        task.group = group
        task.last_group_id = group.id
        task.started_at = now
        self.timeline.started(task, group)
        task.deadline = begun.first_deadline(task, now, self.config.start_timeout_s)
        task.begun_ranks.clear()
        task.ended_ranks.clear()
        task.results.clear()
        task.pg_seqs.clear()
        task.groups.append(group.id)
        run = run_message(task, group)
        frame = protocol.encode_for(run, group.rank_features or frozenset())
        tracepoints.mark(task.submit.task_id, "broker dispatches")
        for rank in group.ranks.values():
            if not self.send_rank(rank.identity, frame):
                return f"rank {rank.rank} is unreachable"
        return ""

    def rank_done(self, group: Group, rank_no: int, message: protocol.RankDone) -> None:
        task = group.task
        if task is None or task.submit.task_id != message.task_id or group.state != "busy":
            return  # a late report for a task already decided
        try:
            refusal = refusals.check(message, rank_no, group.rank_features)
        except refusals.InvalidReport as exc:
            self.unreadable(group, rank_no, str(exc))
            return
        group.bound_env.update(message.bound_env)
        if refusal is not None:
            self._refused(task, group, refusal)
            return
        if message.coverage:
            task.coverage[rank_no] = message.coverage
        result = task.results[rank_no] = message.result
        task.pg_seqs[rank_no] = message.pg_seq
        if len(task.results) == group.spec.world_size:
            if task.cancel_until is not None:
                self._interrupted(task, group)
            else:
                self.complete(task)
        elif result.outcome == "failed" and task.grace_until is None and not task.cancel_until:
            task.grace_until = self.clock.monotonic() + self.config.failure_grace_s

    def unreadable(self, group: Group, rank_no: int, reason: str) -> None:
        """A rank of a busy group sent what the broker cannot read (a frame that does not
        decode, a report at odds with itself): its part of the task is unknown, so the task
        ends now as an ``error`` naming the rank, instead of waiting for its deadline (fail
        closed, and fast), and the group, in an unknown state, is recycled. Not retried:
        a rank that speaks another protocol would do it again."""
        task = group.task
        if task is None or group.state != "busy":
            return  # nothing waits on it (the frame was counted as junk)
        why = f"rank {rank_no} of group {group.id} sent a report the broker cannot read"
        log.warning("%s: %s", why, reason)
        self.group_requests.append(GroupRequest(group, f"{why}: {reason[:200]}"))
        results = [task.results[r] for r in sorted(task.results)]
        self.finish(task, "error", f"{why} ({reason[:1000]}); the group was recycled", results)

    def _refused(self, task: Task, group: Group, refusal: refusals.Refusal) -> None:
        """A rank ran nothing: the task goes to a fresh group, or ends (see
        :mod:`cpq.broker.refusals`). Not an attempt, since nothing ran."""
        decision = refusals.decide(task, refusal, group.spec.world_size, self.start_bound)
        self.group_requests.append(GroupRequest(group, decision.stop_group))
        task.groups.pop()  # nothing ran on it
        self._unassign(task)
        if decision.error:
            self.finish(task, "error", message=decision.error)
            return
        log.info("%s goes to a fresh group (%s)", task.submit.target, decision.bounce)
        task.stale_bounces += 1
        task.spec = decision.spec or task.spec
        self._requeue(task, decision.bounce, group.id, front=True)

    def _interrupted(self, task: Task, group: Group) -> None:
        """Every rank reported after a cancel: kept or recycled (:mod:`cpq.broker.interrupts`)."""
        results = [task.results[r] for r in sorted(task.results)]
        self.finish(task, "error", message=interrupts.CANCELLED, ranks=results)
        why = interrupts.recycle_reason(task, group.spec.world_size)
        self.group_requests.append(GroupRequest(group, why))

    def _unassign(self, task: Task) -> None:
        task.group = None
        task.results.clear()
        task.pg_seqs.clear()
        task.grace_until = task.stacks_until = task.cancel_until = None
        task.stacks.clear()
        task.stack_phases.clear()
        task.coverage.clear()

    def rank_begun(self, group: Group, rank_no: int, message: protocol.RankBegun) -> None:
        """A rank starts the test's own protocol, or ends it (:mod:`cpq.broker.begun`)."""
        task = group.task
        if task is None or task.submit.task_id != message.task_id or task.stacks_until:
            return
        now, start = self.clock.monotonic(), self.config.start_timeout_s
        begun.rank_begun(task, rank_no, group.spec.world_size, now, start)

    def rank_stacks(self, group: Group, rank_no: int, message: protocol.RankStacks) -> None:
        task = group.task
        if task is None or task.submit.task_id != message.task_id or task.stacks_until is None:
            return
        task.stacks[rank_no] = message.stacks
        if message.phase:
            task.stack_phases[rank_no] = message.phase
        task.stack_output[rank_no] = (message.stdout, message.stderr)
        if set(task.stacks) >= hangs.stack_ranks(task):
            self._stacks_collected(task)

    def tick(self, now: float) -> None:
        """Deadlines, the grace after a peer failed, and the wait for stacks."""
        for task in list(self.tasks.values()):
            group = task.group
            if group is None or group.task is not task:
                continue
            if task.cancel_until is not None:
                if now >= task.cancel_until:
                    why = f"did not stop within {self.config.cancel_grace_s:g}s of a cancel"
                    self.group_requests.append(GroupRequest(group, why))
                    self.finish(task, "error", message=interrupts.CANCELLED)
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
        outcome, message = verdict(results, group.spec.world_size)
        held = self.debug.open(task, group, outcome, results)  # names debug_rank: before
        self.finish(task, outcome, message=message, ranks=results)  # the verdict goes first
        if not held:
            self.group_requests.append(GroupRequest(group))

    def _collect_stacks(self, task: Task, reason: str) -> None:
        assert task.group is not None
        task.stacks_reason = reason
        task.stacks_until = self.clock.monotonic() + self.config.stack_wait_s
        frame = protocol.encode(protocol.DumpStacks(task_id=task.submit.task_id))
        for rank_no in hangs.stack_ranks(task):
            self.send_rank(task.group.ranks[rank_no].identity, frame)

    def _stacks_collected(self, task: Task) -> None:
        group = task.group
        assert group is not None
        task.stacks_until = None
        stacks = hangs.stacks_text(task)
        if task.stacks_reason == "deadline":
            reason = hangs.deadline_passed(task)
            self.group_requests.append(GroupRequest(group, reason))
            self.infra_error(task, reason, f"where each rank was:\n{stacks}", "deadline")
            return
        message, stop_reason = hangs.mark_stuck(task, self.config.failure_grace_s)
        results = [task.results[r] for r in sorted(task.results)]
        if not self.debug.open(task, group, "failed", results):  # recycled after the session
            self.group_requests.append(GroupRequest(group, stop_reason))
        self.finish(task, "failed", message=message, ranks=results)

    def infra_error(
        self, task: Task, reason: str, detail: str = "", cause: protocol.Cause = ""
    ) -> None:
        """An infrastructure failure of a running task: retry once, then ``error``.

        ``reason`` is one line; ``detail`` (rank stacks, say) goes into the verdict once;
        ``cause`` is what the verdict's client acts on (``TaskResult.cause``).
        """
        group_id = task.group.id if task.group else ""
        self._unassign(task)
        if task.orphaned:
            self.finish(task, "error", message=join(reason, detail), cause=cause)
            return
        self.retry_once(task, reason, detail, group_id=group_id, front=True, cause=cause)

    def start_failed(
        self, spec: protocol.PoolSpec, reason: str, log_tail: str, only: str = ""
    ) -> None:
        """No group of ``spec`` came up (and none is left to try): its queued tasks get one
        more try, then an error carrying the end of the group's log. ``only``: the key of
        the one task the group was started for (``fresh_group``); the others wait on."""
        detail = f"--- end of the group's log ---\n{log_tail}"
        for task in self.queues.remove(lambda t: t.spec == spec and (not only or t.key == only)):
            self.retry_once(task, reason, detail)

    def retry_once(
        self,
        task: Task,
        reason: str,
        detail: str = "",
        group_id: str = "",
        front: bool = False,
        cause: protocol.Cause = "",
    ) -> None:
        """An infra failure: queue the task again (``front``: ahead of its client's other
        tasks) while it has attempts left, else its verdict (:mod:`cpq.broker.retries`)."""
        if retries.another_attempt(task):
            self._requeue(task, f"retried: {reason}", group_id, front)
            retries.retried(task, reason, detail, group_id)
            self.totals.retries += 1
            log.info("retrying %s: %s", task.submit.target, reason)
            return
        message = retries.final_message(task, reason, detail, group_id)
        self.finish(task, "error", message=message, cause=cause)

    def _requeue(self, task: Task, why: str, group_id: str, front: bool) -> None:
        """The attempt is over (``why``, in the timeline): the task joins its queue again."""
        self.timeline.attempt(task, why, group_id)
        task.queued_at = self.clock.monotonic()
        self.timeline.queued(task)
        self.queues.push(task, front=front)

    def stop_all(self, why: str) -> None:
        for task in list(self.tasks.values()):
            self.finish(task, "error", message=f"the broker stopped: {why}")

    def finish(
        self,
        task: Task,
        outcome: protocol.Outcome,
        message: str = "",
        ranks: list[RankResult] | None = None,
        cause: protocol.Cause = "",
    ) -> None:
        """The task's verdict: it leaves the broker's books and goes to its client."""
        self.tasks.pop(task.key, None)
        self.verdicts.send(task, outcome, message, ranks, cause)

    def take_group_requests(self) -> list[GroupRequest]:
        requests, self.group_requests = self.group_requests, []
        return requests


def run_message(task: Task, group: Group) -> protocol.RunTask:
    """What every rank of ``group`` gets for ``task``: the task's variables only when they
    differ from what the group's ranks got last (feature ``env-delta``; docs/design.md
    "Dispatch"), else ``env_same``."""
    env = task.submit.env
    same = (group.last_env is env or group.last_env == env) and "env-delta" in (
        group.rank_features or ()
    )
    group.last_env = env
    return protocol.RunTask(
        task_id=task.submit.task_id,
        target=task.submit.target,
        kwargs=task.submit.kwargs,
        seed=task.submit.seed,
        test_id=task.submit.test_id,
        env=None if same else env,
        env_same=same,
        debug=task.submit.debug_rank is not None,
        rng=task.submit.rng,
        coverage=task.submit.coverage,
    )
