"""What placement remembers between snapshots: which specs ran lately, for whom, how long
their groups took to start and how much memory they held, which group ran which affinity
key, and which spares failed.

Written only by the broker, where an event is measured (:mod:`cpq.broker.pools`: a task
given a group, a group ready, a spare failed); read by the placement's steps through
:class:`~cpq.broker.placement.view.SpecHistory`. No step writes it.

Why affinity: a test's first run in a process pays for its kernels (Transformer Engine's
first case of an attention configuration builds cuDNN plans for seconds), so with several
idle groups of its spec a task goes to the one that last ran its key (the plugin sends the
test function's node id without its parametrisation, or the marker's ``affinity=``). A
preference only: a task never waits for that group.
"""

from __future__ import annotations

import statistics

from cpq.broker.placement.view import DEFAULT_RANK_MB
from cpq.protocol import PoolSpec

#: After a spare of a spec failed (it would not start, or died idle), none is started for
#: that spec for this long; its tasks still get groups the ordinary way.
RETRY_AFTER_S = 60.0

#: Affinity keys remembered at most (the oldest are forgotten first): a suite's functions.
MAX_KEYS = 4096


class History:
    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self.last_used: dict[PoolSpec, float] = {}
        self.failed_at: dict[PoolSpec, float] = {}
        #: Per spec, the last few measured spawns (seconds from start to ready).
        self.spawn_s: dict[PoolSpec, list[float]] = {}
        #: Per spec, the last few measured ready RSS of a whole group (MB, sum of its ranks).
        self.ready_rss_mb: dict[PoolSpec, list[float]] = {}
        #: Per spec, the clients that used it, and when last.
        self.clients: dict[PoolSpec, dict[bytes, float]] = {}
        self._keys: dict[tuple[PoolSpec, str], str] = {}

    # ---- written where it happens

    def used(self, spec: PoolSpec, now: float, client: bytes, key: str, group_id: str) -> None:
        """A task of ``spec`` from ``client`` with affinity ``key`` was given ``group_id``."""
        self.last_used[spec] = now
        self.clients.setdefault(spec, {})[client] = now
        if key:
            self._keys.pop((spec, key), None)  # re-inserted last: the oldest go first
            self._keys[(spec, key)] = group_id
            if len(self._keys) > self.max_keys:
                del self._keys[next(iter(self._keys))]

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

    def spare_failed(self, spec: PoolSpec, now: float) -> None:
        self.failed_at[spec] = now

    def forget(self, now: float, window_s: float) -> None:
        """Drop the specs not used within ``window_s`` (their spares go)."""
        for spec in [s for s, used in self.last_used.items() if now - used > window_s]:
            del self.last_used[spec]
            self.failed_at.pop(spec, None)
            self.clients.pop(spec, None)

    # ---- read by the steps

    def recent(self, spec: PoolSpec, now: float, window_s: float = float("inf")) -> bool:
        used = self.last_used.get(spec)
        return used is not None and now - used <= window_s

    def spawn_cost(self, spec: PoolSpec, now: float, window_s: float) -> float:
        """Seconds the tests of ``spec`` would wait for a spawn without a spare: the median
        of its last measured spawns times its clients within the window (0 unmeasured)."""
        users = self.clients.get(spec, {})
        recent = sum(1 for seen in users.values() if now - seen <= window_s)
        spawns = self.spawn_s.get(spec)
        return statistics.median(spawns) * max(recent, 1) if spawns else 0.0

    def wanted_spares(self, now: float, window_s: float) -> list[PoolSpec]:
        """Specs that should have a spare now (used within the window, not in a failure's
        back-off), the costliest spawn first; ties: the most recently used first."""
        specs = [
            spec
            for spec, used in self.last_used.items()
            if now - used <= window_s
            and now - self.failed_at.get(spec, -RETRY_AFTER_S) >= RETRY_AFTER_S
        ]
        return sorted(specs, key=lambda s: (-self.spawn_cost(s, now, window_s), -self.last_used[s]))

    def memory_need(self, spec: PoolSpec) -> float:
        """What a group of ``spec`` holds when ready (MB): the largest of its last measured
        ready RSS; before any, its world size times the median rank of the groups measured
        so far (ranks of one interpreter and torch hold alike); before any measurement at
        all, :data:`~cpq.broker.placement.view.DEFAULT_RANK_MB` a rank."""
        measured = self.ready_rss_mb.get(spec)
        if measured:
            return max(measured)
        per_rank = [
            mb / other.world_size for other, sizes in self.ready_rss_mb.items() for mb in sizes
        ]
        return (statistics.median(per_rank) if per_rank else DEFAULT_RANK_MB) * spec.world_size

    def group_for(self, spec: PoolSpec, key: str) -> str:
        """The group that last ran ``key`` ("" when none did, or no key)."""
        return self._keys.get((spec, key), "") if key else ""

    def affinity_keys(self) -> int:
        return len(self._keys)
