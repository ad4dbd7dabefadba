"""Making room: which groups a start that does not fit may stop, and in which order.

Never a busy or starting group of a task (its work would be lost), never while room is
already on its way back (a stopping group's GPUs or memory return when it is reaped), and
only if stopping them makes the start fit:

* first spares (idle or starting) of specs with nothing queued, least recently used first;
* then, with ``used`` (the spec has no live group, or its task asked for its own session's
  groups), idle used groups, those whose spec has tasks queued last;
* with ``own_session``, idle groups of the spec itself that served another session count as
  others: they can never take that task, and were they not candidates it would wait for good
  behind idle groups filling the room (docs/design.md, "Groups of one's own");
* with ``same_spec`` (a task that runs only on a group started for it), every idle group of
  the spec counts as another's, for the same reason.

A group reserved for a task (``fresh_group``) is never stopped for another's room.

Every stop says what it made room for and which budget was short.
"""

from __future__ import annotations

from cpq.broker.placement.plan import Plan
from cpq.broker.placement.view import GroupView
from cpq.protocol import PoolSpec


def make_room(
    plan: Plan,
    spec: PoolSpec,
    since: float,
    used: bool,
    own_session: str | None = None,
    same_spec: bool = False,
) -> bool:
    """Stop what must go for a group of ``spec`` to fit; True when something was stopped."""
    if plan.stopping():
        return False
    candidates = order(plan, spec, used, own_session, same_spec)
    for count in range(1, len(candidates) + 1):
        victims = candidates[:count]
        if plan.fits_after(spec, since, victims):
            budget = plan.budget_words(spec)
            for victim in victims:
                plan.stop(victim, f"evicted for a {spec.label()} group: {budget}", "evicted")
            return True
    return False


def order(
    plan: Plan,
    spec: PoolSpec,
    used: bool,
    own_session: str | None = None,
    same_spec: bool = False,
) -> list[GroupView]:
    """The groups that may go for ``spec``, in the order they go."""
    groups = [g for g in plan.groups.values() if not plan.is_new(g) and not g.reserved_for]
    others = [g for g in groups if g.spec != spec]
    if same_spec:
        others += [g for g in groups if g.spec == spec and g.state == "idle"]
    elif own_session is not None:
        others += [
            g
            for g in groups
            if g.spec == spec and g.state == "idle" and not g.sessions <= {own_session}
        ]
    # Only what holds the room this spec lacks: CPU groups hold memory, GPU groups GPUs.
    cpu = plan.is_cpu(spec)
    others = [g for g in others if (g.cpu if cpu else bool(g.gpus))]
    spares = sorted(
        (
            g
            for g in others
            if g.spare and g.state in ("starting", "idle") and not plan.queued(g.spec)
        ),
        key=lambda g: g.last_used,
    )
    rest = sorted(
        (g for g in others if used and g.state == "idle" and g not in spares),
        key=lambda g: (plan.queued(g.spec) > 0, g.last_used),
    )
    return spares + rest
