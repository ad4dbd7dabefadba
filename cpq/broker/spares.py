"""Spare groups: one clean group per recently used spec, ready when a group must be replaced.

Why: every event that replaces a group — a failure that recycles it, a deadline, a cancel
that left it mid-collective, an edit of the user's code (``code changed:``), a memory or
task-count bound — used to make the next task of that spec wait for a whole spawn (seconds
on CPU; 20-30 s with Transformer Engine on GPUs). A *spare* is a group that has run no
task: it imported cpq, torch and its spec's preloads (``CPQ_PRELOAD``) and none of the
user's code, so it is fresh by construction (its ranks still run the code check before
every task: cpq's own files and the site-packages directories are watched).

The rules, carried out by :class:`~cpq.broker.pools.Pools` (this module only decides):

* one spare per spec that ran a task within ``spare_window_s`` (``--spares 1``, the
  default; ``--spares 0`` keeps none);
* a spare starts only when no task is queued (queued tasks come first for room) and only
  into free room: starting a spare never evicts anything;
* a spare is used last: a task goes to an idle used group of its spec first (its imports
  are warm), to the spare only when none is idle — or first when its previous group found
  the code changed (the other used groups loaded the same code);
* a spare is evicted first: when another spec needs room, idle or starting spares of
  specs with no queued task go before idle used groups, and a spec that grows may evict
  spares even while it has groups of its own (a spare never blocks another spec's task);
* a spare of a spec not used within the window is stopped; a spare that failed is not
  replaced for :data:`RETRY_AFTER_S` (a broken interpreter must not spawn in a loop);
* on a tight budget the spare goes where a spawn would cost the waiting tests most: specs
  are ranked by the median of their last measured spawns (start to ready, taken when a
  group of the spec became ready) times the clients that used the spec within the window
  (each of them would wait for that spawn). A spec that does not fit may stop the spares of
  specs whose spawns cost less (never a used group; equal costs never trade) to make room:
  a ws=2 spec whose spawn costs 7 s for two xdist workers takes the room a ws=1 spare held.

* on CPU, a spare is held in memory rather than in a core when it fits: an idle rank
  computes nothing, so ``--max-ranks`` (cores) bounds the ranks that run tasks, and spares
  may also live beyond it within ``--spare-memory`` (each reserving its spec's measured ready
  RSS, the sum over its ranks, until it takes a task or stops). A ws=1 and a ws=2 group on a
  ``--max-ranks 4`` box then both keep their spare. Such a spare takes a task only when its
  ranks fit ``--max-ranks`` beside the other groups, not counting groups that are stopping
  (the one it replaces, typically); it is never evicted to make room (it holds none). Idle
  *used* groups still count against ``--max-ranks``: a task of their spec may arrive at any
  moment and would find no core, while a spare takes a task only when a group of its spec
  is replaced, which frees the cores that group held.

Once a spare takes a task it is an ordinary group, and the next tick starts a new spare.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable

from cpq.broker.model import Group
from cpq.protocol import PoolSpec

#: After a spare of a spec failed (it would not start, or died idle), none is started for
#: that spec for this long; its tasks still get groups the ordinary way.
RETRY_AFTER_S = 60.0


class SparePolicy:
    """Which specs should have a spare now: those used recently, and not failing."""

    def __init__(self, count: int, window_s: float) -> None:
        self.count = count
        self.window_s = window_s
        self.last_used: dict[PoolSpec, float] = {}
        self.failed_at: dict[PoolSpec, float] = {}
        #: Per spec, the last few measured spawns (seconds from start to ready).
        self.spawn_s: dict[PoolSpec, list[float]] = {}
        #: Per spec, the last few measured ready RSS of a whole group (MB, sum of its ranks).
        self.ready_rss_mb: dict[PoolSpec, list[float]] = {}
        #: Per spec, the clients that used it, and when last.
        self.clients: dict[PoolSpec, dict[bytes, float]] = {}

    @property
    def enabled(self) -> bool:
        return self.count > 0

    def used(self, spec: PoolSpec, now: float, client: bytes = b"") -> None:
        """A task of ``spec`` (from ``client``) was given a group now."""
        self.last_used[spec] = now
        self.clients.setdefault(spec, {})[client] = now

    def spawned(self, spec: PoolSpec, seconds: float, rss_mb: float = 0.0) -> None:
        """A group of ``spec`` became ready ``seconds`` after it was started, its ranks
        holding ``rss_mb`` together (both measured)."""
        recent = self.spawn_s.setdefault(spec, [])
        recent.append(seconds)
        del recent[:-5]
        if rss_mb > 0:
            sizes = self.ready_rss_mb.setdefault(spec, [])
            sizes.append(rss_mb)
            del sizes[:-5]

    def memory_need(self, spec: PoolSpec) -> float:
        """What a spare of ``spec`` held in memory reserves: the largest of its last measured
        ready RSS (0 before any measurement: then it needs room in ``--max-ranks``)."""
        return max(self.ready_rss_mb.get(spec) or [0.0])

    def cost(self, spec: PoolSpec, now: float) -> float:
        """Seconds the tests of ``spec`` would wait for a spawn without a spare: the median of
        its last measured spawns times its clients within the window (0 before any
        measurement)."""
        users = self.clients.get(spec, {})
        recent = sum(1 for seen in users.values() if now - seen <= self.window_s)
        spawns = self.spawn_s.get(spec)
        return statistics.median(spawns) * max(recent, 1) if spawns else 0.0

    def failed(self, spec: PoolSpec, now: float) -> None:
        """A spare of ``spec`` failed now: hold off replacing it."""
        self.failed_at[spec] = now

    def recent(self, spec: PoolSpec, now: float) -> bool:
        used = self.last_used.get(spec)
        return used is not None and now - used <= self.window_s

    def wanted(self, now: float) -> list[PoolSpec]:
        """Specs that should have a spare now (recently used, not in a failure's back-off),
        the costliest first; forgets specs whose window has passed."""
        for spec in [s for s in self.last_used if not self.recent(s, now)]:
            del self.last_used[spec]
            self.failed_at.pop(spec, None)
            self.clients.pop(spec, None)
        if not self.enabled:
            return []
        specs = [
            spec
            for spec in self.last_used
            if now - self.failed_at.get(spec, -RETRY_AFTER_S) >= RETRY_AFTER_S
        ]
        # costliest first (see the module docstring); ties: most recently used first
        return sorted(specs, key=lambda s: (-self.cost(s, now), -self.last_used[s]))


def pick_idle(
    idle: list[Group], preferred: str, fresh: bool, own_session: str | None = None
) -> Group | None:
    """Which of a spec's idle groups takes the next task: a spare first when ``fresh`` (the
    task's last group found its code changed), else the ``preferred`` group (affinity), else
    the most recently used one; a spare only when no used group is idle. With
    ``own_session``, only groups that served no other session are candidates."""
    if own_session is not None:
        idle = [g for g in idle if g.sessions <= {own_session}]
    spares = [g for g in idle if g.spare]
    if fresh and spares:
        return spares[0]
    used = [g for g in idle if not g.spare]
    if not used:
        return spares[0] if spares else None
    for group in used:
        if group.id == preferred:
            return group
    return max(used, key=lambda g: g.last_used)


def eviction_order(
    groups: Iterable[Group],
    spec: PoolSpec,
    queued: Callable[[PoolSpec], bool],
    used: bool,
    own_session: str | None = None,
) -> list[Group]:
    """Groups that may be stopped to make room for ``spec``, in order: spares (idle or
    starting) of other specs with nothing queued, least recently used first; then, with
    ``used``, idle used groups, those whose spec has tasks ``queued`` last.

    With ``own_session`` (a task that asked for groups of its own session) an idle group of
    ``spec`` itself that served another session counts as one of another spec: it can never
    take this task, and were it not a candidate the task would wait for good behind idle
    groups filling the room (docs/design.md, "Groups of one's own")."""
    groups = list(groups)
    others = [g for g in groups if g.spec != spec]
    if own_session is not None:
        others += [
            g
            for g in groups
            if g.spec == spec and g.state == "idle" and not g.sessions <= {own_session}
        ]
    spares = sorted(
        (g for g in others if g.spare and g.state in ("starting", "idle") and not queued(g.spec)),
        key=lambda g: g.last_used,
    )
    rest = sorted(
        (g for g in others if used and g.state == "idle" and g not in spares),
        key=lambda g: (queued(g.spec), g.last_used),
    )
    return spares + rest
