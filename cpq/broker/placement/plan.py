"""The working state of one placement: the snapshot's groups as the decisions so far left
them, what each costs, and the decisions themselves.

A step never changes a group or the budget by hand: it calls :meth:`Plan.run`,
:meth:`Plan.start`, :meth:`Plan.stop`, ... which record the decision and update the working
copy the same way the broker will when it carries the decision out, so the next step sees
the node as it will be (a group given a task is busy; a group stopped still holds its room
until it is reaped; a group started holds its room at once).

The budget (docs/design.md, "Placement"): a GPU group holds its GPUs, disjoint unless
``--oversubscribe``; a CPU group costs memory while it lives (its measured RSS, else its
spec's last measured ready RSS, else :data:`~cpq.broker.placement.view.DEFAULT_RANK_MB` a
rank) within ``--memory``, and cores only while it runs a task: the ranks of busy CPU groups
stay within ``--max-ranks``. An idle rank computes nothing; a busy one needs a core.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence

from cpq.broker.placement.decisions import Decision, Run, Start, Stop, WantGpus, Yield
from cpq.broker.placement.view import GroupView, Queued, Snapshot, Want
from cpq.protocol import PoolSpec

#: ``since`` of a start no task waits for (a spare, a warm-up): every want is older.
NO_TASK = float("inf")


class Plan:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.room = snapshot.room
        self.now = snapshot.now
        self.decisions: list[Decision] = []
        self.groups: dict[str, GroupView] = {g.id: g for g in snapshot.groups}
        self._known = frozenset(self.groups)
        #: Per spec, its queued tasks not given a group yet, in queue order.
        self.pending: dict[PoolSpec, list[Queued]] = {
            q.spec: list(q.tasks) for q in snapshot.queues
        }
        self.depth: dict[PoolSpec, int] = {q.spec: q.depth for q in snapshot.queues}
        #: An older CPU task waits for cores: no younger CPU task may take them first.
        self.cores_reserved = False
        self._starts = 0

    # ---- looking

    def live(self, spec: PoolSpec) -> list[GroupView]:
        """The spec's groups that may serve its tasks (a group reserved for one task,
        ``fresh_group``, serves no other: it is that task's alone, :meth:`reserved`)."""
        return [
            g
            for g in self.groups.values()
            if g.spec == spec and g.state != "stopping" and not g.reserved_for
        ]

    def idle(self, spec: PoolSpec) -> list[GroupView]:
        return [
            g
            for g in self.groups.values()
            if g.spec == spec and g.state == "idle" and not g.reserved_for
        ]

    def reserved(self, task: str) -> GroupView | None:
        """The live group started for the task keyed ``task`` (``fresh_group``), if any."""
        for group in self.groups.values():
            if group.reserved_for == task and group.state != "stopping":
                return group
        return None

    def queued(self, spec: PoolSpec) -> int:
        """Tasks of ``spec`` still waiting after the decisions so far."""
        return self.depth.get(spec, 0)

    def anything_queued(self) -> bool:
        return any(self.depth.values())

    def is_new(self, group: GroupView) -> bool:
        """Started by this placement: it has no id yet, so no later decision may name it."""
        return group.id not in self._known

    def stopping(self) -> bool:
        """Room is on its way back: some group is stopping."""
        return any(g.state == "stopping" for g in self.groups.values())

    def is_cpu(self, spec: PoolSpec) -> bool:
        return not self.room.uses_gpus(spec)

    # ---- the budget

    def cores_used(self) -> int:
        return sum(g.ranks for g in self.groups.values() if g.cpu and g.state == "busy")

    def cores_free_for(self, spec: PoolSpec) -> bool:
        """May a task of CPU ``spec`` start computing now (its ranks find cores)?"""
        return self.cores_used() + spec.world_size <= self.room.max_ranks

    def memory_used(self) -> float:
        """What CPU groups hold, stopping ones too (until they are reaped)."""
        return sum(g.memory_mb for g in self.groups.values() if g.cpu)

    def memory_need(self, spec: PoolSpec) -> float:
        return self.snapshot.history.memory_need(spec)

    def memory_fits(self, spec: PoolSpec, freed_mb: float = 0.0) -> bool:
        """Would a new group of CPU ``spec`` fit ``--memory`` (after ``freed_mb`` goes)?
        A group bigger than the whole budget still runs alone."""
        held = self.memory_used() - freed_mb
        return held + self.memory_need(spec) <= self.room.memory_mb or held <= 0

    def gpu_users(self) -> Counter[str]:
        return Counter(gpu for g in self.groups.values() for gpu in g.gpus)

    def usable_gpus(self, spec: PoolSpec, since: float) -> list[str]:
        """GPUs a new group of ``spec`` (for a task queued ``since``) may take now: allowed
        to its caller, not held by another broker, not named by an older want of another
        broker, and (without ``--oversubscribe``) used by none of this broker's groups."""
        snap = self.snapshot
        foreign = snap.foreign
        return [
            gpu
            for gpu in self.room.allowed_gpus(spec)
            if gpu not in snap.held_elsewhere
            and may_take(snap.uuids.get(gpu, gpu), since, snap.me, foreign)
        ]

    def gpus_for(self, spec: PoolSpec, since: float) -> tuple[str, ...] | None:
        """The GPUs a new group of ``spec`` would start on now, None if too few are free."""
        ws = spec.world_size
        users = self.gpu_users()
        usable = self.usable_gpus(spec, since)
        free = [g for g in usable if not users[g]]
        if len(free) >= ws:
            return tuple(free[:ws])
        if self.room.oversubscribe and len(usable) >= ws:
            return tuple(sorted(usable, key=lambda g: users[g])[:ws])
        return None

    def fits(self, spec: PoolSpec, since: float) -> tuple[str, ...] | None:
        """Where a new group of ``spec`` would go now: its GPUs (``()`` on CPU), None when
        it does not fit."""
        if self.is_cpu(spec):
            return () if self.memory_fits(spec) else None
        return self.gpus_for(spec, since)

    def fits_after(self, spec: PoolSpec, since: float, victims: Iterable[GroupView]) -> bool:
        """Would ``spec`` fit once ``victims`` are gone?"""
        victims = list(victims)
        if self.is_cpu(spec):
            return self.memory_fits(spec, sum(v.memory_mb for v in victims if v.cpu))
        users = self.gpu_users()
        for victim in victims:
            users.subtract(victim.gpus)
        usable = self.usable_gpus(spec, since)
        return sum(1 for g in usable if users[g] <= 0) >= spec.world_size

    def budget_words(self, spec: PoolSpec) -> str:
        """The budget ``spec`` meets, in words, for a stop's reason."""
        if self.is_cpu(spec):
            return (
                f"CPU groups may hold {self.room.memory_mb:.0f} MB (--memory), "
                f"{self.memory_used():.0f} MB held"
            )
        users = self.gpu_users()
        free = [g for g in self.room.allowed_gpus(spec) if not users[g]]
        return f"{spec.world_size} GPU(s) needed, {len(free)} free"

    # ---- deciding

    def run(self, spec: PoolSpec, task: Queued, group: GroupView) -> None:
        self.decisions.append(Run(spec, task.key, group.id))
        self.pending[spec].remove(task)
        self.depth[spec] -= 1
        sessions = group.sessions | {task.session}
        self.groups[group.id] = dataclasses.replace(
            group, state="busy", spare=False, sessions=sessions, last_used=self.now, reserved_for=""
        )

    def start(
        self,
        spec: PoolSpec,
        gpus: tuple[str, ...],
        spare: bool,
        why: str,
        since: float | None,
        for_task: str = "",
    ) -> GroupView:
        self._starts += 1
        ref = f"+{self._starts}"
        self.decisions.append(Start(spec, gpus, spare, why, since, ref, for_task))
        cpu = self.is_cpu(spec)
        group = GroupView(
            ref,
            spec,
            "starting",
            gpus,
            spare=spare,
            cpu=cpu,
            memory_mb=self.memory_need(spec) if cpu else 0.0,
            last_used=self.now,
            reserved_for=for_task,
        )
        self.groups[ref] = group
        return group

    def stop(self, group: GroupView, why: str, cause: str) -> None:
        self.decisions.append(Stop(group.id, why, cause))
        self.groups[group.id] = dataclasses.replace(group, state="stopping")

    def yield_group(self, group: GroupView, why: str) -> None:
        self.decisions.append(Yield(group.id, why))
        self.groups[group.id] = dataclasses.replace(group, state="stopping")

    def want(self, spec: PoolSpec, since: float, need: int, gpus: frozenset[str]) -> None:
        self.decisions.append(WantGpus(spec, since, need, gpus))

    def wants_since(self) -> float | None:
        """When this broker's oldest task waiting for GPUs held elsewhere was queued."""
        return min((d.since for d in self.decisions if isinstance(d, WantGpus)), default=None)


def may_take(uuid: str, since: float, me: str, wants: Sequence[Want]) -> bool:
    """May this broker lock ``uuid`` for a need that waits since ``since``? Not while an
    older want of another broker names it."""
    return not any(uuid in w.gpus and w.key() < (since, me) for w in wants if w.broker != me)
