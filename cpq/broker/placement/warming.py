"""Step 6, warming: groups asked for ahead of tasks (``cpq-broker --warm``, the pytest
plugin's warm-up) start into free room; warming never stops anything.

A warmed group only serves tasks whose spec is equal, roots, interpreter and start variables
included (``cpq-broker --help`` on ``--warm-root``); a mismatch leaves it idle, never wrong.
"""

from __future__ import annotations

from cpq.broker.placement.admission import impossible
from cpq.broker.placement.plan import NO_TASK, Plan


def step(plan: Plan) -> None:
    if plan.snapshot.closing:
        return
    for spec, count in plan.snapshot.warm:
        if impossible(spec, plan.room):
            continue
        for _ in range(max(0, count - len(plan.live(spec)))):
            gpus = plan.fits(spec, NO_TASK)
            if gpus is None:
                break
            plan.start(spec, gpus, spare=False, why="warm-up", since=None)
