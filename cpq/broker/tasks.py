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
from collections.abc import Callable
from dataclasses import dataclass

from cpq import protocol
from cpq.broker import hangs, retries
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

#: Fresh groups a task may find stale in a row before it is an error (a file that changes
#: all the time, such as a module a test writes and imports, would bounce it forever).
MAX_STALE_BOUNCES = 3


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
        """Stop a running task nobody waits for any more, instead of holding its group until
        the deadline: every rank is asked to interrupt it (``cpq.rank.cancel``); ranks that
        do report within ``cancel_grace_s`` leave the group clean, else it is recycled."""
        task.orphaned = True  # the verdict goes nowhere
        group = task.group
        if group is None or task.cancel_until is not None:
            return
        log.info("interrupting %s on group %s: %s", task.submit.target, group.id, why)
        task.cancel_until = self.clock.monotonic() + self.config.cancel_grace_s
        task.grace_until = task.stacks_until = None
        frame = protocol.encode(protocol.CancelTask(task_id=task.submit.task_id))
        for rank_no, rank in group.ranks.items():
            if rank_no not in task.results:
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
        task.deadline = now + task.timeout_s
        task.results.clear()
        task.pg_seqs.clear()
        task.groups.append(group.id)
        run = run_message(task, group)
        frame = protocol.encode_for(run, group.rank_features or frozenset())
        for rank in group.ranks.values():
            if not self.send_rank(rank.identity, frame):
                return f"rank {rank.rank} is unreachable"
        return ""

    def rank_done(self, group: Group, rank_no: int, message: protocol.RankDone) -> None:
        task = group.task
        if task is None or task.submit.task_id != message.task_id or group.state != "busy":
            return  # a late report for a task already decided
        group.bound_env.update(message.bound_env)
        if message.stale and message.stale_start:
            self._stale_at_start(task, group, message.stale)
            return
        if message.stale:
            self.stale(task, group, message.stale)
            return
        if message.coverage:
            task.coverage[rank_no] = message.coverage
        result = message.result
        result.rank = rank_no
        task.results[rank_no] = result
        task.pg_seqs[rank_no] = message.pg_seq
        if len(task.results) == group.spec.world_size:
            if task.cancel_until is not None:
                self._interrupted(task, group)
            else:
                self.complete(task)
        elif result.outcome == "failed" and task.grace_until is None and not task.cancel_until:
            task.grace_until = self.clock.monotonic() + self.config.failure_grace_s

    def stale(self, task: Task, group: Group, path: str) -> None:
        """The group loaded code that changed on disk since (``cpq.rank.freshness``): it
        runs nothing more, and the task goes to a fresh group. Not an attempt: nothing ran
        (a rank that did start is stopped with the group)."""
        what = "environment" if path.startswith("the variable ") else "code"
        self.group_requests.append(GroupRequest(group, f"{what} changed: {path}"))
        if task.orphaned or task.stale_bounces >= MAX_STALE_BOUNCES:
            task.groups.pop()
            self._unassign(task)
            message = (
                "cancelled: its client went away"
                if task.orphaned
                else f"{path} keeps changing: {task.stale_bounces + 1} fresh groups in a row "
                "found it changed after loading it"
            )
            self.finish(task, "error", message=message)
            return
        log.info("%s changed since group %s loaded it: %s goes to a fresh group",
                 path, group.id, task.submit.target)  # fmt: skip
        self._bounce(task, group, f"bounced: {what} changed")

    def _bounce(self, task: Task, group: Group, why: str) -> None:
        """Take ``task`` off ``group`` (nothing of it ran) and queue it again, in front."""
        self.timeline.attempt(task, why, group.id)
        task.groups.pop()
        self._unassign(task)
        task.stale_bounces += 1
        task.queued_at = self.clock.monotonic()
        self.timeline.queued(task)
        self.queues.push(task, front=True)

    def _stale_at_start(self, task: Task, group: Group, variable: str) -> None:
        """An import read ``variable`` while the group started, with another value than the
        task's: every group of the spec starts alike, so a fresh one would read the same.
        The group stays (its other tasks may agree). The spec learns the name
        (:mod:`cpq.broker.startenv`) and the task goes, in front, to a group started with the
        caller's value; where the caller has no value to start with, the task is an error
        that says how to make the variable part of the spec."""
        # One rank's refusal says nothing of its peers: one of them may be running the body,
        # waiting in a collective for this rank. A group of one rank is clean; others go.
        why = (
            "" if group.spec.world_size == 1 else f"a rank refused a task: {variable} read at start"
        )
        self.group_requests.append(GroupRequest(group, why))
        name = variable.removeprefix("the variable ")
        self.start_bound.learn(task.submit.spec, name)
        widened = self.start_bound.widen(task.submit.spec, task.submit.env)
        if widened != task.spec and task.stale_bounces < MAX_STALE_BOUNCES and not task.orphaned:
            log.info("%s is read at group start: %s goes to a group started with it", name,
                     task.submit.target)  # fmt: skip
            task.spec = widened
            self._bounce(task, group, f"bounced: {name} read at start")
            return
        self.finish(
            task,
            "error",
            message=f"{name} was read while cpq's group started (importing torch, cpq or "
            f"CPQ_PRELOAD), with another value than this test's: list it in CPQ_SPEC_ENV "
            f"(CPQ_SPEC_ENV={name}) so its groups start with your value",
        )

    def _interrupted(self, task: Task, group: Group) -> None:
        """Every rank reported after a cancel: the group is clean when each rank left the
        task after the same number of collectives (none was left half-done)."""
        seqs = set(task.pg_seqs.values())
        clean = group.spec.world_size == 1 or (len(seqs) == 1 and -1 not in seqs)
        results = [task.results[r] for r in sorted(task.results)]
        self.finish(task, "error", message="cancelled: its client went away", ranks=results)
        why = "" if clean else f"interrupted mid-collective (sequence numbers {sorted(seqs)})"
        self.group_requests.append(GroupRequest(group, why))

    def _unassign(self, task: Task) -> None:
        task.group = None
        task.results.clear()
        task.pg_seqs.clear()
        task.grace_until = task.stacks_until = task.cancel_until = None
        task.stacks.clear()
        task.stack_phases.clear()
        task.coverage.clear()

    def rank_begun(self, group: Group, message: protocol.RankBegun) -> None:
        """A rank starts the test's own protocol: its deadline runs from now (the rank's
        pytest session build and collection are not the test's time)."""
        task = group.task
        if task is None or task.submit.task_id != message.task_id or task.stacks_until:
            return
        task.deadline = max(task.deadline, self.clock.monotonic() + task.timeout_s)

    def rank_stacks(self, group: Group, rank_no: int, message: protocol.RankStacks) -> None:
        task = group.task
        if task is None or task.submit.task_id != message.task_id or task.stacks_until is None:
            return
        task.stacks[rank_no] = message.stacks
        if message.phase:
            task.stack_phases[rank_no] = message.phase
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
                    self.finish(task, "error", message="cancelled: its client went away")
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
            phases = task.stack_phases
            task.hung_phase = next((phases[r] for r in sorted(phases)), "")
            reason = hangs.deadline_passed(task)
            self.group_requests.append(GroupRequest(group, reason))
            self.infra_error(task, reason, f"where each rank was:\n{stacks}")
            return
        failed, stuck = hangs.mark_stuck(task, self.config.failure_grace_s)
        results = [task.results[r] for r in sorted(task.results)]
        if not self.debug.open(task, group, "failed", results):  # recycled after the session
            self.group_requests.append(
                GroupRequest(group, f"rank(s) {stuck} stuck after a peer failed")
            )
        self.finish(
            task,
            "failed",
            message=f"rank(s) {failed} failed; rank(s) {stuck} were stuck; the group was recycled",
            ranks=results,
        )

    def infra_error(self, task: Task, reason: str, detail: str = "") -> None:
        """An infrastructure failure of a running task: retry once, then ``error``.

        ``reason`` is one line; ``detail`` (rank stacks, say) goes into the verdict once.
        """
        group_id = task.group.id if task.group else ""
        self._unassign(task)
        if task.orphaned:
            self.finish(task, "error", message=join(reason, detail))
            return
        self.retry_once(task, reason, detail, group_id=group_id, front=True)

    def start_failed(self, spec: protocol.PoolSpec, reason: str, log_tail: str) -> None:
        """No group of ``spec`` came up (and none is left to try): its queued tasks get one
        more try, then an error carrying the end of the group's log."""
        detail = f"--- end of the group's log ---\n{log_tail}"
        for task in self.queues.remove(lambda t: t.spec == spec):
            self.retry_once(task, reason, detail)

    def retry_once(
        self, task: Task, reason: str, detail: str = "", group_id: str = "", front: bool = False
    ) -> None:
        """An infra failure: queue the task again (``front``: ahead of its client's other
        tasks) while it has attempts left, else its verdict (:mod:`cpq.broker.retries`)."""
        if retries.another_attempt(task):
            self.timeline.attempt(task, f"retried: {reason}", group_id)
            retries.retried(task, reason, detail, group_id)
            self.totals.retries += 1
            log.info("retrying %s: %s", task.submit.target, reason)
            task.queued_at = self.clock.monotonic()
            self.timeline.queued(task)
            self.queues.push(task, front=front)
            return
        self.finish(task, "error", message=retries.final_message(task, reason, detail, group_id))

    def stop_all(self, why: str) -> None:
        for task in list(self.tasks.values()):
            self.finish(task, "error", message=f"the broker stopped: {why}")

    def finish(
        self,
        task: Task,
        outcome: protocol.Outcome,
        message: str = "",
        ranks: list[RankResult] | None = None,
    ) -> None:
        """The task's verdict: it leaves the broker's books and goes to its client."""
        self.tasks.pop(task.key, None)
        self.verdicts.send(task, outcome, message, ranks)

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
