"""Step 4, yielding: which of this broker's groups give their GPUs to another broker's
waiting task. After growth, so that this broker's own wants of this placement count.

Pure rules (no files, no clock of its own), so they are unit-tested on plain values:

* a broker whose task waits for GPUs held elsewhere publishes a :class:`Want` (how many GPUs
  it still needs, which ones, since when its oldest waiting task waits), refreshed every
  tick; a want not refreshed for :data:`STALE_S` is ignored (its broker is gone or served);
* a holder stops idle groups and spares (idle or starting) on wanted GPUs, spares first,
  then least recently used, until the want's need is covered (counting its groups already
  stopping there); busy groups and groups starting for a task are never touched;
* the oldest want is served first, and a holder with an older want of its own keeps its
  GPUs (no yielding to a younger need while it waits itself);
* a free GPU goes to the oldest want that lists it: a broker takes a GPU only when no older
  foreign want names it (:func:`may_take`), so a broker that just yielded does not take the
  GPU back, and a spare (which has no waiting task: its "since" is now) always defers.

Times are wall-clock seconds: wants are compared between processes of one node.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from cpq.broker.placement.plan import Plan, may_take
from cpq.broker.placement.view import Want

__all__ = ["STALE_S", "Holding", "Want", "may_take", "parse_wants", "shortfall", "step", "to_yield"]

#: A want not rewritten for this long is ignored (the broker rewrites it every tick).
STALE_S = 1.0


@dataclass(frozen=True)
class Holding:
    """One of this broker's groups, as the yield rule sees it."""

    group: str
    gpus: frozenset[str]  # UUIDs
    state: str  # starting | idle | busy | stopping
    spare: bool
    last_used: float


def parse_wants(docs: Iterable[dict[str, Any]], me: str, now: float) -> list[Want]:
    """The fresh wants of other brokers in want-file contents, oldest first. A document
    that is not a well-formed want is skipped (it can only delay a yield, never cause a
    shared GPU: ownership is the lock)."""
    out = []
    for doc in docs:
        broker, refreshed, entries = doc.get("broker"), doc.get("refreshed"), doc.get("wants")
        if not isinstance(broker, str) or broker == me or not isinstance(entries, list):
            continue
        if not _finite(refreshed) or now - refreshed > STALE_S:
            continue  # NaN would never go stale: not a number a broker wrote
        who = str(doc.get("who", broker))
        for entry in entries:
            want = _want(broker, who, entry)
            if want is not None:
                out.append(want)
    return sorted(out, key=Want.key)


def _finite(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _want(broker: str, who: str, entry: object) -> Want | None:
    if not isinstance(entry, dict):
        return None
    since, need, gpus = entry.get("since"), entry.get("need"), entry.get("gpus")
    if not _finite(since) or not isinstance(need, int) or need < 1:
        return None
    if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
        return None
    return Want(broker, float(since), need, frozenset(gpus), who, str(entry.get("spec", "")))


def to_yield(
    wants: Sequence[Want], mine: Sequence[Holding], my_since: float | None
) -> list[tuple[str, Want]]:
    """``(group id, want)`` for each group of mine to stop now. ``my_since``: when my own
    oldest GPU-waiting task was queued (None: I want nothing)."""
    chosen: dict[str, Want] = {}
    order = sorted(
        (h for h in mine if _yieldable(h)), key=lambda h: (not h.spare, h.last_used, h.group)
    )
    for want in sorted(wants, key=Want.key):
        if my_since is not None and my_since <= want.since:
            continue  # I have waited longer: I keep what I hold
        # GPUs on their way back count, except those just chosen for an older want: the
        # older want gets them first.
        stopping = (h for h in mine if h.state == "stopping" and h.group not in chosen)
        covered = sum(len(h.gpus & want.gpus) for h in stopping)
        for holding in order:
            if covered >= want.need:
                break
            if holding.group in chosen or not holding.gpus & want.gpus:
                continue
            chosen[holding.group] = want
            covered += len(holding.gpus & want.gpus)
    return list(chosen.items())


def _yieldable(holding: Holding) -> bool:
    """Idle groups and spares (idle or still starting); never busy ones."""
    return holding.state == "idle" or (holding.spare and holding.state == "starting")


def shortfall(world_size: int, lockable: int, freeing: int) -> int:
    """GPUs still missing for a group of ``world_size``: beyond those this broker can lock
    now and those its own stopping groups are about to return."""
    return max(0, world_size - lockable - freeing)


def step(plan: Plan) -> None:
    snap = plan.snapshot
    if not snap.foreign:
        return
    held_gpus = {g.id: g for g in plan.groups.values() if g.gpus and not plan.is_new(g)}
    mine = [
        Holding(
            g.id,
            frozenset(snap.uuids.get(gpu, gpu) for gpu in g.gpus),
            g.state,
            g.spare,
            g.last_used,
        )
        for g in held_gpus.values()
    ]
    for group_id, want in to_yield(snap.foreign, mine, plan.wants_since()):
        waited = f"{want.spec or 'a GPU task'}, waiting {snap.wall - want.since:.1f}s"
        plan.yield_group(held_gpus[group_id], f"yielded its GPUs to {want.who} ({waited})")
