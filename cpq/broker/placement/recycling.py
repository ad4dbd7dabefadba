"""Step 1, recycling: an idle group that must not serve another task is stopped.

After ``--max-tasks-per-group`` tasks, when a rank said it cannot serve another (``unfit``:
say, no free file descriptors), or when a rank's memory grew past ``--max-rss-growth``
since the group was ready. Long-lived ranks accumulate what tests leave behind (caches,
leaked tensors, fragmented allocators); a fresh group after N tasks or after a memory bound
keeps that from turning into out-of-memory failures in unrelated later tests. First, so
that no later step gives such a group a task.
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
