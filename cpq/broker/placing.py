"""The broker's side of placement: the snapshot it takes, the decisions it carries out.

:mod:`cpq.broker.placement` decides from a :class:`~cpq.broker.placement.view.Snapshot`;
this module builds that snapshot from the live state (groups, queues, leases, other
brokers' wants) and carries each decision out in order on :class:`~cpq.broker.pools.Pools`,
:class:`~cpq.broker.tasks.Tasks` and :class:`~cpq.broker.sharing.GpuSharing`. What
carrying out measures (a GPU found leased by another broker; a rank that cannot be reached)
goes into the next snapshot; :meth:`Placer.place` asks again until nothing changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cpq.broker.model import Group, Task, session_of
from cpq.broker.placement import express, recycling
from cpq.broker.placement.decisions import Decision, Run, Start, Stop, WantGpus, Yield
from cpq.broker.placement.steps import Placement, Steps
from cpq.broker.placement.view import Bounds, Queued, QueueView, Snapshot
from cpq.broker.pools import Pools
from cpq.broker.tasks import Tasks
from cpq.protocol import PoolSpec

log = logging.getLogger("cpq.broker")

#: Placements one :meth:`Placer.place` may ask for (each after a start found a GPU taken):
#: a bound, so a lease that fails in a way the snapshot cannot show never spins the loop.
MAX_ROUNDS = 4


@dataclass
class Requests:
    """What the broker asks of placement besides its queued tasks: groups ahead of tasks."""

    warm: list[tuple[PoolSpec, int]] = field(default_factory=list)


class Placer:
    def __init__(self, pools: Pools, tasks: Tasks, placement: Placement | None = None) -> None:
        self.pools = pools
        self.tasks = tasks
        self.placement: Placement = placement or Steps()
        self.requests = Requests()

    def snapshot(self, closing: bool) -> Snapshot:
        pools, queues = self.pools, self.tasks.queues
        now = pools.clock.monotonic()
        views = []
        for spec in queues.waiting_specs():
            queue = queues.by_spec[spec]
            idle = sum(1 for g in pools.groups.values() if g.spec == spec and g.state == "idle")
            head = tuple(_queued(task) for task in queue.head(idle + 1))  # all that may run
            views.append(QueueView(spec, head, len(queue), queue.oldest()))
        leases, sharing = pools.leases, pools.sharing
        return Snapshot(
            now=now,
            wall=pools.clock.time(),
            room=pools.room,
            groups=pools.view(self._reservable()),
            queues=tuple(views),
            history=pools.history,
            bounds=self._bounds(),
            held_elsewhere=leases.held_elsewhere(now) if leases else frozenset(),
            foreign=tuple(sharing.foreign) if sharing else (),
            uuids=pools.config.gpu_uuids,
            me=leases.me if leases else "",
            closing=closing,
            warm=tuple(self.requests.warm),
        )

    def _bounds(self) -> Bounds:
        config = self.pools.config
        return Bounds(
            config.spares,
            config.spare_window_s,
            config.scale_up_after_s,
            config.max_tasks_per_group,
            config.max_rss_growth_mb,
            config.idle_release_s,
        )

    def after_release(self, group: Group) -> bool:
        """Whether ``group``, just released by its task, gives placement something to do at
        once: a task waits (it may go there), another broker wants GPUs (it may yield
        them), or the group must not serve again (recycled, and a spare may replace it).
        What else placement would decide of it (a spare beside it, an idle group
        released) waits for the next tick or submit, at most one tick."""
        sharing = self.pools.sharing
        if self.tasks.queues or (sharing is not None and sharing.foreign):
            return True
        return bool(recycling.recycle_reason(self.pools.view_of(group), self._bounds()))

    def _reservable(self) -> frozenset[str] | None:
        """The queued tasks that may hold a reserved group (None: no group is reserved,
        the common case, which then costs no walk over the queues)."""
        if not any(g.reserved_for for g in self.pools.groups.values()):
            return None
        return frozenset(t.key for t in self.tasks.queues if t.submit.fresh_group)

    def express(self, closing: bool) -> bool:
        """Send the one queued task to its group now, when the answer is plain
        (:mod:`cpq.broker.placement.express`); True when it went. The whole placement runs
        after it either way: what it decides besides (spares, growth) is off the task's path."""
        queues, pools = self.tasks.queues, self.pools
        if closing or self.requests.warm or len(queues) != 1:
            return False
        if pools.sharing is not None and pools.sharing.foreign:
            return False
        task = next(iter(queues))
        submit = task.submit
        if submit.fresh_group or submit.own_groups or task.stale_bounces:
            return False
        spec, idle, busy_cpu = task.spec, [], 0
        for group in pools.groups.values():
            if group.reserved_for:
                return False
            cpu = not pools.room.uses_gpus(group.spec)
            if group.state == "busy" and cpu:
                busy_cpu += group.spec.world_size
            elif group.state == "idle" and group.spec == spec:
                idle.append(pools.view_of(group))
        cores_left = None if pools.room.uses_gpus(spec) else pools.room.max_ranks - busy_cpu
        preferred = pools.history.group_for(spec, submit.affinity)
        now = pools.clock.monotonic()
        chosen = express.pick(idle, preferred, session_of(task), now, self._bounds(), cores_left)
        if chosen is None:
            return False
        self.carry_out([Run(spec, task.key, chosen.id)])
        return True

    def place(self, closing: bool) -> None:
        """Decide and carry out until a placement's decisions all took effect."""
        for _ in range(MAX_ROUNDS):
            decisions = self.placement.decide(self.snapshot(closing))
            self.requests.warm = []  # asked once: a group that did not fit is not retried
            if self.carry_out(decisions):
                return

    def carry_out(self, decisions: list[Decision]) -> bool:
        """Carry ``decisions`` out in order; False when one could not be (a GPU was found
        leased elsewhere, a rank unreachable): the rest are dropped and placement asked
        again with what that showed."""
        pools, tasks = self.pools, self.tasks
        for decision in decisions:
            if isinstance(decision, Run):
                task = tasks.queues.pop(decision.spec)
                group = pools.groups[decision.group]
                assert task is not None and task.key == decision.task, (decision, task)
                pools.assign(group, task)
                unreachable = tasks.start(task, group)
                if unreachable:
                    pools.fail(group, unreachable)
                    return True  # settle() carries the failure out and places again
            elif isinstance(decision, Start):
                gpus, spare = list(decision.gpus), decision.spare
                if pools.start(decision.spec, gpus, spare, decision.for_task) is None:
                    # torchrun did not start: a failure settle() carries out, then places
                    # again; else a GPU was leased elsewhere: the next snapshot shows it
                    return bool(pools.failures)
            elif isinstance(decision, Stop):
                group = pools.groups[decision.group]
                if decision.cause == "evicted":
                    kind = "spare" if group.spare else "idle"
                    log.info(
                        "evicting %s group %s (%s): %s",
                        kind,
                        group.id,
                        group.spec.label(),
                        decision.why,
                    )
                pools.stop(
                    group, decision.why, recycled=decision.cause == "recycled", cause=decision.cause
                )
            elif isinstance(decision, Yield):
                # An idle group runs no user code: no grace, its GPUs go to the waiting
                # broker now. The timeline counts it as an eviction (for another broker).
                group = pools.groups[decision.group]
                pools.stop(group, decision.why, recycled=False, cause="evicted", grace_s=0.0)
                if pools.sharing is not None:
                    pools.sharing.yields += 1
            elif isinstance(decision, WantGpus):
                if pools.sharing is not None:
                    label = f"ws{decision.spec.world_size} #{decision.spec.digest()}"
                    pools.sharing.want(label, decision.since, decision.need, set(decision.gpus))
            else:  # a decision this broker does not know: a bug, never ignored
                raise TypeError(f"unknown placement decision {decision!r}")
        return True


def _queued(task: Task) -> Queued:
    return Queued(
        task.key,
        task.client,
        session_of(task),
        task.submit.affinity,
        fresh=task.stale_bounces > 0,
        own_groups=task.submit.own_groups,
        fresh_group=task.submit.fresh_group,
    )
