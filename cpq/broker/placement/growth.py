"""Step 3, growth: a group starts for queued tasks that no idle group took.

When a spec grows: always when it has no live group; otherwise only when none of its groups
is starting and its oldest task has waited ``--scale-up-after`` since the pool could first
have served (a warm group clears a queue of fast tests in milliseconds, far sooner than a
new group could start, so extra groups are for queues that stay long). A task that asked
for groups of its own session (``own_groups``) whose spec has no group it may use and none
starting gets one too. A task that asked for a group started for it (``fresh_group``) gets
one of its own whenever none is live for it, however many groups of its spec are idle: only
that group may take it, and it takes no other task first (:mod:`.affinity`).

Where there is no room, room is made, oldest queued spec first (:mod:`.eviction` says
whom it stops); GPUs that other brokers hold are wanted from them (:mod:`.yielding`).
"""

from __future__ import annotations

from collections.abc import Sequence

from cpq.broker.placement import eviction
from cpq.broker.placement.plan import Plan
from cpq.broker.placement.view import GroupView, QueueView
from cpq.broker.placement.yielding import shortfall
from cpq.protocol import PoolSpec


def step(plan: Plan) -> None:
    for queue in plan.snapshot.queues:
        spec = queue.spec
        if not plan.queued(spec):
            continue
        live = plan.live(spec)
        head = plan.pending[spec][0] if plan.pending.get(spec) else None
        if head is not None and head.fresh_group:
            if plan.reserved(head.key) is None:
                start_fresh(plan, queue, head.key)
            continue  # the spec's queue waits for the head's own group
        own = head.session if head is not None and head.own_groups else None
        if (
            own is not None
            and not any(g.state == "starting" for g in live)
            and not any(g.sessions <= {own} for g in live)
        ):
            grow, evict = True, True
        elif any(g.state == "idle" for g in live) or (
            live and plan.is_cpu(spec) and not plan.cores_free_for(spec)
        ):
            continue  # its task waits for cores: a new group would wait too
        else:
            grow = should_grow(live, queue.oldest, plan.now, plan.snapshot.bounds.scale_up_after_s)
            evict = not live
        if grow:
            start_for(plan, queue, evict, own)


def should_grow(
    live: Sequence[GroupView], oldest_queued_at: float, now: float, scale_up_after_s: float
) -> bool:
    """Start another group for a spec whose live groups are ``live``?"""
    if not live:
        return True
    if any(g.state == "starting" for g in live):
        return False
    # Waiting counts from when the pool could first have served: time spent waiting for the
    # pool's own start says nothing about whether it keeps up.
    since = max(oldest_queued_at, max(g.ready_at for g in live))
    return now - since >= scale_up_after_s


def start_for(plan: Plan, queue: QueueView, evict: bool, own_session: str | None) -> None:
    """Start a group of the queue's spec, or make room for one (the next placement starts
    it, once the room is back)."""
    spec = queue.spec
    since = plan.snapshot.wall - (plan.now - queue.oldest)  # wall clock, for wants
    gpus = plan.fits(spec, since)
    if gpus is not None:
        plan.start(spec, gpus, spare=False, why=f"{plan.queued(spec)} task(s) queued", since=since)
        return
    eviction.make_room(plan, spec, since, used=evict, own_session=own_session)
    if not plan.is_cpu(spec):
        want_gpus(plan, spec, since)


def start_fresh(plan: Plan, queue: QueueView, task: str) -> None:
    """Start the group the task keyed ``task`` runs on alone, or make room for it: idle
    groups of its own spec count as others (none of them may take it)."""
    spec = queue.spec
    since = plan.snapshot.wall - (plan.now - queue.oldest)
    gpus = plan.fits(spec, since)
    if gpus is not None:
        why = "a fresh group for one task"
        plan.start(spec, gpus, spare=False, why=why, since=since, for_task=task)
        return
    eviction.make_room(plan, spec, since, used=True, same_spec=True)
    if not plan.is_cpu(spec):
        want_gpus(plan, spec, since)


def want_gpus(plan: Plan, spec: PoolSpec, since: float) -> None:
    """Tell other brokers what a task of ``spec`` lacks of the GPUs they hold (or an older
    want of theirs names): beyond the GPUs it could take now and those this broker's
    stopping groups return."""
    allowed = set(plan.room.allowed_gpus(spec))
    users = plan.gpu_users()
    usable = set(plan.usable_gpus(spec, since))
    takeable = {g for g in usable if not users[g]}
    blocked = {g for g in allowed if not users[g] and g not in usable}
    returning = {gpu for g in plan.groups.values() if g.state == "stopping" for gpu in g.gpus}
    returning &= allowed
    need = shortfall(spec.world_size, len(takeable), len(returning))
    wanted = blocked - returning
    if need and wanted:
        plan.want(spec, since, need, frozenset(wanted))
