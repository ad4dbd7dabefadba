"""Dispatch first: the one queued task's group, where placement's answer is plain.

Why (docs/design.md "Dispatch"): on the round trip of a short test, the broker reads a
submit, places, and only then sends the task to its ranks. A whole placement (a snapshot of
every group, six steps) is a third of the broker's Python per task, and almost all of it
decides what is not urgent: spares, growth, warm groups, yielding. So when exactly one task
waits and its group is plain to see, the broker sends it there first and runs the whole
placement right after, off the task's path.

"Plain" is narrow on purpose, so that the answer is the one :mod:`.affinity` would give
after :mod:`.recycling`: :func:`pick` sees the task's spec's idle groups and takes
:func:`~cpq.broker.placement.affinity.pick_idle`'s choice, unless recycling would stop that
group first (its own bound, or released idle), or a CPU task would find no cores. Everything
else (another task queued, a reserved or own group, a task bounced for stale code, a warm
request, another broker's want, a closing broker) goes to the whole placement, as before.
``tests/unit/test_express.py`` holds the two to the same answer.
"""

from __future__ import annotations

from cpq.broker.placement.affinity import pick_idle
from cpq.broker.placement.recycling import recycle_reason
from cpq.broker.placement.view import Bounds, GroupView


def pick(
    idle: list[GroupView],
    preferred: str,
    session: str,
    now: float,
    bounds: Bounds,
    cores_left: int | None,
) -> GroupView | None:
    """The group of ``idle`` (the spec's idle, unreserved groups) that takes the task, or
    None: let the whole placement decide. ``cores_left``: the CPU ranks that may still
    compute (None for a GPU spec)."""
    group = pick_idle(idle, preferred, fresh=False, session=session)
    if group is None or recycle_reason(group, bounds):
        return None
    if cores_left is not None and group.ranks > cores_left:
        return None
    if bounds.idle_release_s and not group.spare and now - group.last_used >= bounds.idle_release_s:
        newest = max((g for g in idle if not g.spare), key=lambda g: (g.last_used, g.id))
        if group is not newest:  # recycling's release_idle would stop it first
            return None
    return group
