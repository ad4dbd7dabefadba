"""When a group that finished a task cleanly is replaced instead of serving another.

One policy, read by :meth:`cpq.broker.pools.Pools.release`: after ``--max-tasks-per-group``
tasks, when a rank said it cannot serve another (``unfit``: say, no free file descriptors),
or when a rank's memory grew past ``--max-rss-growth`` since the group was ready.
"""

from __future__ import annotations

from cpq.broker.config import BrokerConfig
from cpq.broker.model import Group


def recycle_reason(group: Group, config: BrokerConfig) -> str:
    """Why a group that just finished a task cleanly must not serve another ("": it may).

    Long-lived ranks accumulate what tests leave behind (caches, leaked tensors,
    fragmented allocators); a fresh group after N tasks or after a memory bound keeps
    that from turning into out-of-memory failures in unrelated later tests.
    """
    limit = config.max_tasks_per_group
    if limit and group.tasks_done >= limit:
        return f"recycled after {group.tasks_done} tasks"
    for rank_no, why in sorted(group.unfit.items()):
        return f"recycled: rank {rank_no} {why}"
    bound = config.max_rss_growth_mb
    if bound:
        for rank_no, rss in sorted(group.rss_mb.items()):
            base = group.rss_ready_mb.get(rank_no, 0.0)
            if base > 0 and rss - base > bound:  # 0: a rank that reported no baseline
                return (
                    f"recycled: rank {rank_no} RSS grew {rss - base:.0f} MB since ready "
                    f"(--max-rss-growth {bound:g})"
                )
    return ""
