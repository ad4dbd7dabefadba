"""Pools: the groups (one torchrun each), their ranks, and the GPU leases they hold.

A pool is every group of one :class:`~cpq.protocol.PoolSpec`. This module starts the groups
placement decides on (:mod:`cpq.broker.placement`; it decides nothing itself), stops and
reaps them, records what placement remembers where it is measured (:attr:`Pools.history`),
and watches groups every tick: torchrun's exit code, silent ranks, a start that takes too
long. What goes wrong is reported as :class:`GroupFailed` events in :attr:`Pools.failures`;
pools never call the task lifecycle, the loop (:mod:`cpq.broker.loop`) turns a failure into
a retry or a verdict. See ``docs/design.md``, "Liveness" and "Placement".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cpq import protocol
from cpq.broker import liveness
from cpq.broker.clock import Clock
from cpq.broker.config import BrokerConfig
from cpq.broker.leases import Leases
from cpq.broker.model import Group, GroupProcess, Rank, Task, Totals, session_of
from cpq.broker.placement.history import History
from cpq.broker.placement.view import GroupView, Room
from cpq.broker.sharing import GpuSharing, broker_id
from cpq.broker.timeline import Timeline
from cpq.protocol import PoolSpec

log = logging.getLogger("cpq.broker")

#: Makes a group's process: (group id, spec, dist backend, GPUs, backend endpoint,
#: heartbeat s, liveness, log dir). :class:`cpq.broker.supervisor.GroupProcess` in a real
#: broker, a fake in unit tests.
ProcessFactory = Callable[[str, PoolSpec, str, list[str], str, float, int, Path], GroupProcess]


def real_process(
    group_id: str,
    spec: PoolSpec,
    backend: str,
    gpus: list[str],
    backend_endpoint: str,
    heartbeat_s: float,
    liveness_: int,
    log_dir: Path,
) -> GroupProcess:
    from cpq.broker.supervisor import GroupProcess as Real

    return Real(group_id, spec, backend, gpus, backend_endpoint, heartbeat_s, liveness_, log_dir)


@dataclass
class GroupFailed:
    """A group died, went silent or never came up (it is stopping now)."""

    group: Group
    reason: str
    task: Task | None  # the task it was running, if any
    was_starting: bool
    log_tail: str


class Pools:
    """Every group of this broker, by id, and every registered rank, by socket identity."""

    def __init__(
        self,
        config: BrokerConfig,
        clock: Clock,
        totals: Totals,
        send_rank: Callable[[bytes, bytes], bool],
        backend_endpoint: str,
        process_factory: ProcessFactory = real_process,
        timeline: Timeline | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.totals = totals
        self.send_rank = send_rank
        self.backend_endpoint = backend_endpoint
        self.process_factory = process_factory
        self.timeline = timeline or Timeline(None, 0, clock)
        self.leases: Leases | None = None
        self.sharing: GpuSharing | None = None
        refused: dict[str, str] = {}
        if config.gpu_leases is not None and config.gpus:
            self.leases = Leases(config.gpu_leases, config.gpu_uuids, broker_id(config.endpoint))
            refused = self.leases.prepare(config.gpus)
            self.sharing = GpuSharing(self.leases, clock, config.endpoint)
        self.room = Room(
            tuple(g for g in config.gpus if g not in refused),
            config.max_ranks,
            config.memory_mb,
            config.oversubscribe,
            config.fake_gpus,
            refused,
        )
        self.groups: dict[str, Group] = {}
        self.ranks: dict[bytes, tuple[Group, Rank]] = {}
        self.failures: list[GroupFailed] = []
        self.history = History()
        self._group_seq = 0
        self._shutdown = protocol.encode(protocol.Shutdown())

    # ---- looking

    def live(self, spec: PoolSpec) -> list[Group]:
        return [g for g in self.groups.values() if g.spec == spec and g.state != "stopping"]

    def serving(self, spec: PoolSpec) -> bool:
        """A group of ``spec`` is starting or idle: it may still serve queued tasks."""
        return any(g.spec == spec and g.state in ("starting", "idle") for g in self.groups.values())

    def free_gpus(self) -> list[str]:
        """This broker's GPUs that none of its groups holds (stopping ones hold theirs)."""
        used = {gpu for g in self.groups.values() for gpu in g.process.gpus}
        return [gpu for gpu in self.room.gpus if gpu not in used]

    def cpu_memory_mb(self) -> float:
        """What the CPU groups hold, as placement counts it (``--memory``)."""
        return sum(v.memory_mb for v in self.view() if v.cpu)

    def view(self, queued: frozenset[str] | None = None) -> tuple[GroupView, ...]:
        """The groups as placement sees them; ``queued``: the keys of the queued tasks (a
        group reserved for a task no longer queued, cancelled say, is an ordinary one)."""
        return tuple(self.view_of(g, queued) for g in self.groups.values())

    def view_of(self, group: Group, queued: frozenset[str] | None = None) -> GroupView:
        cpu = not self.room.uses_gpus(group.spec)
        memory = 0.0
        if cpu:  # measured where it can be; a group not ready yet holds its spec's estimate
            need = self.history.memory_need(group.spec)
            measured = sum(group.rss_mb.values())
            memory = max(measured, need) if group.state == "starting" else measured or need
        growth = tuple(
            (rank, rss - group.rss_ready_mb[rank])
            for rank, rss in group.rss_mb.items()
            if group.rss_ready_mb.get(rank, 0.0) > 0  # 0: a rank that reported no baseline
        )
        return GroupView(
            group.id,
            group.spec,
            group.state,
            tuple(group.process.gpus),
            group.spare,
            cpu,
            memory,
            group.last_used,
            group.ready_at,
            frozenset(group.sessions),
            group.tasks_done,
            tuple(sorted(group.unfit.items())),
            growth,
            group.reserved_for if queued is None or group.reserved_for in queued else "",
        )

    # ---- starting and stopping

    def start(
        self, spec: PoolSpec, gpus: list[str], spare: bool = False, reserved_for: str = ""
    ) -> Group | None:
        """Start a group of ``spec`` on ``gpus``, as placement decided; None when a GPU's
        lease is held elsewhere (:meth:`Leases.held_elsewhere` then says which; nothing is
        taken) or torchrun did not start."""
        now = self.clock.monotonic()
        if self.leases is not None and gpus and not self.leases.take(gpus, now):
            return None
        self._group_seq += 1
        group_id = Group.id_for(self._group_seq, self.config.broker_tag)
        process = self.process_factory(
            group_id,
            spec,
            self.room.dist_backend(spec),
            gpus,
            self.backend_endpoint,
            self.config.heartbeat_s,
            self.config.liveness,
            self.config.log_dir,
        )
        if self.leases is not None:
            process.lease_fds = self.leases.fds(gpus)
        process.node_gpus = bool(self.config.gpus)
        group = Group(
            group_id,
            spec,
            process,
            started_at=now,
            started_wall=self.clock.time(),
            last_used=now,
            spare=spare,
            reserved_for=reserved_for,
        )
        self.groups[group_id] = group
        self.totals.groups_started += 1
        self.timeline.spawn(group)
        try:
            process.start()
        except OSError as exc:
            self.fail(group, f"could not start torchrun: {exc}")
            return None
        log.info(
            "starting %s %s (%s) GPUs=%s pid=%s",
            "spare group" if spare else "group",
            group_id,
            spec.label(),
            gpus or "-",
            process.pid,
        )
        return group

    def stop(
        self,
        group: Group,
        reason: str,
        recycled: bool = True,
        cause: str = "",
        grace_s: float | None = None,
    ) -> None:
        """Stop a group; ``recycled``: replaced because of what happened to it (a failure,
        a deadline, changed code, a cancel, a bound), not to make room for another spec.
        ``cause`` is the timeline's word for it (default: "recycled"); ``grace_s``: before
        SIGKILL (default ``--kill-grace``)."""
        if group.state == "stopping":
            return
        self.timeline.stop(group, reason, cause or "recycled")
        if recycled:
            self.totals.groups_recycled += 1
        log.info("stopping group %s (%s): %s", group.id, group.spec.label(), reason)
        group.state = "stopping"
        group.stop_reason = reason
        group.task = None
        if self.leases is not None:
            self.leases.drop(group.process.gpus)  # its processes keep theirs until they exit
        for rank in group.ranks.values():
            self.send_rank(rank.identity, self._shutdown)
            self.ranks.pop(rank.identity, None)
        grace = self.config.kill_grace_s if grace_s is None else grace_s
        group.process.terminate(self.clock.monotonic() + grace)

    def rank_stale(self, group: Group, message: protocol.RankStale) -> None:
        """An idle rank found its code changed (``RankStale``): stop the group now. A group
        that took a task meanwhile is left to that task's own check, which refuses it."""
        if group.state != "idle" or group.task is not None:
            return
        self.stop(group, f"code changed since it started: {message.path}")

    def fail(self, group: Group, reason: str) -> None:
        """A rank died, went silent, or the group never came up: stop it, report it."""
        if group.state == "stopping":
            return
        if group.spare:
            self.history.spare_failed(group.spec, self.clock.monotonic())
        failure = GroupFailed(
            group, reason, group.task, group.state == "starting", group.process.log_tail()
        )
        self.totals.groups_failed += 1
        self.stop(group, reason, cause="failed")
        log.warning("group %s failed: %s", group.id, reason)
        self.failures.append(failure)

    def take_failures(self) -> list[GroupFailed]:
        failures, self.failures = self.failures, []
        return failures

    # ---- serving

    def assign(self, group: Group, task: Task) -> None:
        group.state = "busy"
        group.task = task
        group.spare = False  # an ordinary group now; placement starts a new spare
        group.reserved_for = ""  # ... and one that served its task: not reserved any more
        group.last_used = now = self.clock.monotonic()
        group.sessions.add(session_of(task))
        self.history.used(group.spec, now, task.client, task.submit.affinity, group.id)

    def release(self, group: Group) -> None:
        """A group finished its task cleanly: back to idle (placement may recycle it:
        :mod:`cpq.broker.placement.recycling`)."""
        if group.state == "stopping":
            return
        group.task = None
        group.tasks_done += 1
        group.last_used = self.clock.monotonic()
        group.state = "idle"

    # ---- ranks

    def rank_hello(self, identity: bytes, message: protocol.RankHello) -> Rank | None:
        group = self.groups.get(message.group_id)
        if group is None or group.process.token != message.token or group.state == "stopping":
            log.warning(
                "refusing rank hello for group %s (unknown, stopping or bad token)",
                message.group_id,
            )
            return None
        rank = Rank(identity, message.rank, message.pid, last_seen=self.clock.monotonic())
        group.ranks[message.rank] = rank
        group.process.rank_pids.add(message.pid)
        self.ranks[identity] = (group, rank)
        return rank

    def rank_ready(self, group: Group, rank: Rank, message: protocol.RankReady) -> bool:
        """Record a rank's readiness; True when this made its whole group ready."""
        if not group.note_ready(rank, message) or group.state != "starting":
            return False
        now = self.clock.monotonic()
        group.state = "idle"
        group.ready_at = group.last_used = now
        group.ready_after_s = now - group.started_at
        self.history.spawned(group.spec, group.ready_after_s, sum(group.rss_ready_mb.values()))
        self.totals.group_start_s += group.ready_after_s
        self.timeline.ready(group)
        log.info("group %s (%s) ready in %.2fs", group.id, group.spec.label(), group.ready_after_s)
        return True

    def rank_report(self, group: Group, rank: Rank, message: protocol.RankDone) -> None:
        """What a rank says about itself after a task (memory, fitness)."""
        group.rss_mb[rank.rank] = message.rss_mb
        group.cuda_mb[rank.rank] = message.cuda_mb
        group.cuda_reserved_mb[rank.rank] = message.cuda_reserved_mb
        if message.unfit:
            group.unfit[rank.rank] = message.unfit

    # ---- time

    def tick(self, now: float) -> None:
        """Reap stopped groups (their resources come back), fail broken ones."""
        for group in list(self.groups.values()):
            self._tick_group(group, now)

    def _tick_group(self, group: Group, now: float) -> None:
        if group.state == "stopping":
            if group.process.reap(now):  # its GPUs and memory are back
                del self.groups[group.id]
                self.timeline.gone(group)
            return
        code = group.process.exit_code()
        if code is not None:
            self.fail(group, f"torchrun exited with status {code} (a rank died?)")
            return
        # A rank with work is watched for CPU progress; its deadline (or the start time-out)
        # bounds it. An idle rank runs no user code: silence alone counts.
        working = group.task is not None or group.state == "starting"
        for rank in group.ranks.values():
            quiet, excused = liveness.quiet_for(
                rank.busy_watch,
                now,
                rank.last_seen,
                rank.pid if working else None,
                self.config.heartbeat_s,
                lambda: f"rank {rank.rank} of group {group.id}",  # noqa: B023 - called at once
            )
            self.totals.busy_silences += excused
            if quiet > self.config.silence_s:
                self.fail(
                    group, f"rank {rank.rank} stopped heartbeating ({now - rank.last_seen:.1f}s)"
                )
                return
        if group.state == "starting" and now - group.started_at > self.config.start_timeout_s:
            self.fail(group, f"not ready after {self.config.start_timeout_s:g}s")

    def close(self, sleep: Callable[[float], None]) -> None:
        """Kill every group and wait (a bounded time) until they are gone."""
        now = self.clock.monotonic()
        for group in list(self.groups.values()):
            if group.state != "stopping":
                self.timeline.stop(group, "the broker stopped", "shutdown")
            group.process.terminate(now)
        deadline = now + self.config.kill_grace_s + 2
        while (now := self.clock.monotonic()) < deadline and not all(
            g.process.reap(now) for g in self.groups.values()
        ):
            sleep(0.05)
        for group in self.groups.values():
            group.process.terminate(now)
            group.process.reap(now)
            self.timeline.gone(group)
