"""Keeping spares: what :mod:`cpq.broker.spares` decides, carried out on :class:`Pools`.

Apart from :class:`~cpq.broker.pools.Pools` so that class stays about groups (start, stop,
fail, serve); the rules themselves, and why, are in :mod:`cpq.broker.spares` and
``docs/design.md``, "Spares and affinity".
"""

from __future__ import annotations

from cpq.broker.pools import Pools
from cpq.protocol import PoolSpec


def keep_spares(pools: Pools, may_start: bool) -> None:
    """One spare per recently used spec: stop the spares of specs no longer used, and start
    missing ones (in memory beyond ``--max-ranks`` where they fit, else into free room) when
    ``may_start`` (no task is queued)."""
    policy = pools.spares
    now = pools.clock.monotonic()
    wanted = policy.wanted(now)
    for group in list(pools.groups.values()):
        unused = not policy.recent(group.spec, now)
        if group.spare and group.state != "stopping" and unused:
            why = f"spare unused: no task of its spec for {policy.window_s:g}s"
            pools.stop(group, why, recycled=False, cause="spare-unused")
    if not may_start:
        return
    for spec in wanted:
        if any(g.spare for g in pools.live(spec)) or pools.resources.impossible(spec):
            continue
        if pools.start(spec, spare=True) is None:
            cost = policy.cost(spec, now)
            cheaper = {s for s in wanted if policy.cost(s, now) < cost}
            make_room_for_spare(pools, spec, cheaper)


def make_room_for_spare(pools: Pools, spec: PoolSpec, below: set[PoolSpec]) -> None:
    """Stop spares of the specs ``below`` (whose spawn costs less) if that lets the spare of
    ``spec`` fit (the next tick starts it); a used group is never stopped for a spare, equal
    costs never trade places (that would only churn), and a spare held in memory frees no
    room."""
    groups = pools.groups.values()
    if any(g.state == "stopping" for g in groups):
        return  # room is already on its way back
    victims = [g for g in groups if g.spare and g.spec in below and not g.memory_mb]
    victims.sort(key=lambda g: g.last_used)
    for count in range(1, len(victims) + 1):
        freed = [(v.spec, v.process.gpus) for v in victims[:count]]
        if pools.resources.would_fit_after_freeing(spec, freed):
            for victim in victims[:count]:
                why = f"its room goes to a spare of {spec.label()}, whose spawn costs more"
                pools.stop(victim, why, recycled=False, cause="evicted")
            return
