"""Affinity: which group last ran a task of a given key, so the next one goes there.

Why: a test's first run in a process pays for its kernels (Transformer Engine's first case
of an attention configuration builds cuDNN plans for seconds, torch compiles and caches),
and with several warm groups of one spec a case that lands on a group that never saw its
configuration pays that again. A task may carry an affinity key (the pytest plugin sends
the test function's node id without its parametrisation, or the marker's ``affinity=``);
with several idle groups of its spec, :meth:`cpq.broker.pools.Pools.idle_group` prefers the
one that last ran that key. It is a preference only: a task never waits for that group.
"""

from __future__ import annotations

from cpq.protocol import PoolSpec

#: Keys remembered at most (the oldest are forgotten first): a suite's test functions.
MAX_KEYS = 4096


class Affinity:
    """(spec, key) -> the id of the group that last ran a task with that key."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._last: dict[tuple[PoolSpec, str], str] = {}

    def ran(self, spec: PoolSpec, key: str, group_id: str) -> None:
        """A task with ``key`` was given group ``group_id`` ("" keys are not remembered)."""
        if not key:
            return
        self._last.pop((spec, key), None)  # re-inserted last: the oldest go first
        self._last[(spec, key)] = group_id
        if len(self._last) > self.max_keys:
            del self._last[next(iter(self._last))]

    def group_for(self, spec: PoolSpec, key: str) -> str:
        """The group that last ran ``key`` ("" when none did, or no key)."""
        return self._last.get((spec, key), "") if key else ""

    def __len__(self) -> int:
        return len(self._last)
