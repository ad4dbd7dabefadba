"""Step 1, recycling: an idle group that must not serve another task is stopped.

After ``--max-tasks-per-group`` tasks, when a rank said it cannot serve another (``unfit``:
say, no free file descriptors), or when a rank's memory grew past ``--max-rss-growth``
since the group was ready. Long-lived ranks accumulate what tests leave behind (caches,
leaked tensors, fragmented allocators); a fresh group after N tasks or after a memory bound
keeps that from turning into out-of-memory failures in unrelated later tests. And idle
groups beyond their spec's most recently used one, unused for ``--idle-release``
(:func:`release_idle`). First, so that no later step gives such a group a task.
"""

from __future__ import annotations

from cpq.broker.placement.plan import Plan
from cpq.broker.placement.view import Bounds, GroupView


def step(plan: Plan) -> None:
    for group in list(plan.groups.values()):
        if group.state == "idle":
            why = recycle_reason(group, plan.snapshot.bounds)
            if why:
                plan.stop(group, why, "recycled")
    release_idle(plan)


def release_idle(plan: Plan) -> None:
    """Idle used groups beyond what recent sessions used go after ``--idle-release``: of
    each spec, every idle group but the most recently used one that has not run a task for
    that long (a burst of xdist workers grew the pool; the burst is over). Spares are the
    spares step's; a busy or starting group is never touched. Why not at once: the next
    session of the same shape wants them warm; why at all: on a small node idle groups of
    past sessions held most of the memory (issue 37: 16 idle groups, 7.9 GB)."""
    after = plan.snapshot.bounds.idle_release_s
    if not after:
        return
    now = plan.snapshot.now
    by_spec: dict[object, list[GroupView]] = {}
    for group in plan.groups.values():
        if group.state == "idle" and not group.spare:
            by_spec.setdefault(group.spec, []).append(group)
    for groups in by_spec.values():
        groups.sort(key=lambda g: (g.last_used, g.id), reverse=True)
        for group in groups[1:]:
            idle = now - group.last_used
            if idle >= after:
                plan.stop(
                    group,
                    f"released: idle {idle:.0f}s, beyond its spec's most recently used "
                    f"group (--idle-release {after:g})",
                    "recycled",
                )


def recycle_reason(group: GroupView, bounds: Bounds) -> str:
    """Why ``group`` must not serve another task ("": it may)."""
    limit = bounds.max_tasks_per_group
    if limit and group.tasks_done >= limit:
        return f"recycled after {group.tasks_done} tasks"
    for rank_no, why in sorted(group.unfit):
        return f"recycled: rank {rank_no} {why}"
    bound = bounds.max_rss_growth_mb
    if bound:
        for rank_no, growth in sorted(group.rss_growth_mb):
            if growth > bound:
                return (
                    f"recycled: rank {rank_no} RSS grew {growth:.0f} MB since ready "
                    f"(--max-rss-growth {bound:g})"
                )
    return ""
