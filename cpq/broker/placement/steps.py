"""The placement: its steps in order over one plan (the package docstring says why this
order, :mod:`cpq.broker.placement`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from cpq.broker.placement import affinity, growth, recycling, spares, warming, yielding
from cpq.broker.placement.decisions import Decision
from cpq.broker.placement.plan import Plan
from cpq.broker.placement.view import Snapshot

Step = Callable[[Plan], None]

#: The steps, in the order they run (the module docstring says why this order).
STEPS: tuple[Step, ...] = (
    recycling.step,
    affinity.step,
    growth.step,
    yielding.step,
    spares.step,
    warming.step,
)


class Placement(Protocol):
    """What the broker asks of a placement (pytest-xdist's schedulers are the model)."""

    def decide(self, snapshot: Snapshot) -> list[Decision]: ...


class Steps:
    """The placement: :data:`STEPS` over one plan."""

    def __init__(self, steps: Sequence[Step] = STEPS) -> None:
        self.steps = tuple(steps)

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        plan = Plan(snapshot)
        for step in self.steps:
            step(plan)
        return plan.decisions
