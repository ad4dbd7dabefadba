"""When a pool grows: another group of a spec for its queued tasks.

Always when the spec has no group. Otherwise only when none is already starting and the
oldest task has waited ``--scale-up-after``: a warm group clears a queue of fast tests in
milliseconds, far sooner than a new group could start, so extra groups are for queues that
stay long (slow tests, many concurrent clients). The pytest plugin's warm-up asks for one
group per xdist worker up front, which covers the common case.
"""

from __future__ import annotations

from collections.abc import Sequence

from cpq.broker.model import Group


def should_grow(
    live: Sequence[Group], oldest_queued_at: float, now: float, scale_up_after_s: float
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
