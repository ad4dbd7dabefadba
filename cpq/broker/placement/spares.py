"""Step 5, spares: one clean group per recently used spec, ready when a group must go.

Why: every event that replaces a group — a failure that recycles it, a deadline, a cancel
that left it mid-collective, an edit of the user's code (``code changed:``), a memory or
task-count bound — would make the next task of that spec wait for a whole spawn (seconds on
CPU; 20-30 s with Transformer Engine on GPUs). A *spare* is a group that has run no task: it
imported cpq, torch and its spec's preloads (``CPQ_PRELOAD``) and none of the user's code,
so it is fresh by construction (its ranks still run the code check before every task).

* one spare per spec that ran a task within ``--spare-window`` (``--spares 1``, the
  default; ``--spares 0`` keeps none); the spare of a spec no longer used is stopped;
* a spare starts only when no task is queued (queued tasks come first for room) and only
  into free room (on CPU: memory within ``--memory``; it computes nothing until it takes a
  task), and defers to every want of another broker: starting one never evicts a used group;
* a spare is used last and evicted first (:mod:`.affinity`, :mod:`.eviction`);
* a spare that failed is not replaced for
  :data:`~cpq.broker.placement.history.RETRY_AFTER_S` (a broken interpreter must not spawn
  in a loop);
* on a tight budget the spare goes where a spawn would cost the waiting tests most: specs
  are ranked by the median of their last measured spawns times the clients that used the
  spec within the window. A spec that does not fit may stop the spares of specs whose
  spawns cost less (never a used group; equal costs never trade) to make room.

Once a spare takes a task it is an ordinary group, and the next placement starts a new one.
"""

from __future__ import annotations

from cpq.broker.placement.plan import NO_TASK, Plan
from cpq.broker.placement.view import GroupView
from cpq.protocol import PoolSpec


def step(plan: Plan) -> None:
    snap, bounds = plan.snapshot, plan.snapshot.bounds
    window = bounds.spare_window_s
    for group in list(plan.groups.values()):
        if (
            group.spare
            and group.state != "stopping"
            and not snap.history.recent(group.spec, plan.now, window)
        ):
            plan.stop(group, f"spare unused: no task of its spec for {window:g}s", "spare-unused")
    if not bounds.spares or snap.closing or plan.anything_queued():
        return
    wanted = snap.history.wanted_spares(plan.now, window)
    for spec in wanted:
        if any(g.spare for g in plan.live(spec)) or admission_refuses(plan, spec):
            continue
        gpus = plan.fits(spec, NO_TASK)
        if gpus is not None:
            plan.start(spec, gpus, spare=True, why="spare", since=None)
            continue
        cost = snap.history.spawn_cost(spec, plan.now, window)
        cheaper = {s for s in wanted if snap.history.spawn_cost(s, plan.now, window) < cost}
        make_room_for_spare(plan, spec, cheaper)


def admission_refuses(plan: Plan, spec: PoolSpec) -> bool:
    from cpq.broker.placement.admission import impossible

    return impossible(spec, plan.room) is not None


def make_room_for_spare(plan: Plan, spec: PoolSpec, below: set[PoolSpec]) -> None:
    """Stop spares of the specs ``below`` (whose spawn costs less) if that lets the spare of
    ``spec`` fit (the next placement starts it); equal costs never trade (that would only
    churn)."""
    if plan.stopping():
        return  # room is already on its way back
    victims: list[GroupView] = sorted(
        (
            g
            for g in plan.groups.values()
            if g.spare and g.spec in below and g.state != "stopping" and not plan.is_new(g)
        ),
        key=lambda g: g.last_used,
    )
    for count in range(1, len(victims) + 1):
        if plan.fits_after(spec, NO_TASK, victims[:count]):
            for victim in victims[:count]:
                why = f"its room goes to a spare of {spec.label()}, whose spawn costs more"
                plan.stop(victim, why, "evicted")
            return
