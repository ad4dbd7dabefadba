"""Step 2, affinity: queued tasks go to idle groups of their spec.

Specs in the order their oldest task was queued, each spec's tasks in queue order (per
client round-robin, :mod:`cpq.broker.queues`). Which idle group: the one that last ran the
task's affinity key (:mod:`~cpq.broker.placement.history` says why), else the most recently
used one — but first, the most recently used group that served the task's own calling
session (its tests go on where the session's state is, as in one pytest process); a spare
(a group that has run no task) only when no used group is idle, or first
for a task whose last group found its code changed (``fresh``: the other used groups
loaded the same code); with ``own_groups`` only a group that served no other session; with
``fresh_group`` only the group started for it (:mod:`.growth`), which no other task takes.
While that group starts, the spec's later tasks wait behind it, as behind any head of the
queue (a spawn; docs/design.md, "Confirm on a fresh group").

A CPU task takes its group only when its ranks find cores (busy ranks within
``--max-ranks``); otherwise it waits, and so does every younger CPU task (the oldest want is
served first: a stream of small tasks cannot starve a wide one).
"""

from __future__ import annotations

from cpq.broker.placement.plan import Plan
from cpq.broker.placement.view import GroupView


def step(plan: Plan) -> None:
    for queue in plan.snapshot.queues:
        spec = queue.spec
        for task in list(plan.pending.get(spec, ())):
            if task.fresh_group:
                mine = plan.reserved(task.key)
                group = mine if mine is not None and mine.state == "idle" else None
            else:
                own = task.session if task.own_groups else None
                preferred = plan.snapshot.history.group_for(spec, task.affinity)
                group = pick_idle(plan.idle(spec), preferred, task.fresh, own, task.session)
            if group is None:
                break
            if plan.is_cpu(spec) and (plan.cores_reserved or not plan.cores_free_for(spec)):
                plan.cores_reserved = True
                break
            plan.run(spec, task, group)


def pick_idle(
    idle: list[GroupView],
    preferred: str,
    fresh: bool,
    own_session: str | None = None,
    session: str = "",
) -> GroupView | None:
    """Which of a spec's idle groups takes the next task (see the module docstring)."""
    if own_session is not None:
        idle = [g for g in idle if g.sessions <= {own_session}]
    spares = [g for g in idle if g.spare]
    if fresh and spares:
        return spares[0]
    used = [g for g in idle if not g.spare]
    if not used:
        return spares[0] if spares else None
    # A session's next test goes where its tests ran: what one test leaves reaches the next
    # as in one pytest process (a fresh run's verdicts depend on it).
    home = [g for g in used if session and session in g.sessions]
    if home:
        used = home
    for group in used:
        if group.id == preferred:
            return group
    return max(used, key=lambda g: g.last_used)
