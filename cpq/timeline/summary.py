"""The numbers under the picture: where a run's time went, per group and per spec.

Every figure is a sum or a ratio of measured times (the broker's records); nothing is
estimated. A group's *busy share* is the time its slices of tasks cover divided by the time
it was ready and alive within the window; a group *sat idle* when that share is under
:data:`IDLE_SHARE`. The warm-up line compares the same tests' run times as the first task
on a fresh group and as a later task, where both happened.
"""

from __future__ import annotations

from typing import Any

from cpq.timeline.layout import group_slices
from cpq.timeline.run import Run

IDLE_SHARE = 0.1


def summarize(runs: list[Run], top: int = 10) -> dict[str, Any]:
    groups: list[dict[str, Any]] = []
    spawning: dict[str, float] = {}
    waits: dict[str, list[float]] = {}
    attempts = []
    first_runs: dict[str, list[float]] = {}
    later_runs: dict[str, list[float]] = {}
    for run in runs:
        for group in run.groups:
            slices = group_slices(run, group)
            busy = sum(s.end - s.start for s in slices if s.attempt is not None)
            spawn = sum(s.end - s.start for s in slices if s.kind == "spawn")
            spawning[group.spec] = spawning.get(group.spec, 0.0) + spawn
            ready = max(group.ready, run.start) if group.ready is not None else None
            end = min(group.stop if group.stop is not None else run.end, run.end)
            available = max(0.0, end - ready) if ready is not None else 0.0
            share = busy / available if available > 0 else 0.0
            groups.append(
                {
                    "run": run.source,
                    "group": group.id,
                    "label": group.label,
                    "spec": group.spec,
                    "spare": group.spare,
                    "spawn_s": spawn,
                    "ready_s": available,
                    "busy_s": busy,
                    "busy_share": share,
                    "tasks": sum(1 for s in slices if s.attempt is not None),
                    "stopped": group.cause,
                    "reason": group.reason,
                }
            )
        for a in run.attempts:
            waits.setdefault(a.spec, []).append(a.wait_s)
            attempts.append((run.source, a))
            if a.started is not None and a.outcome == "passed":
                (first_runs if a.first else later_runs).setdefault(a.test, []).append(a.run_s)
    both = sorted(set(first_runs) & set(later_runs))
    warm_up = None
    if both:
        first = [sum(first_runs[t]) / len(first_runs[t]) for t in both]
        later = [sum(later_runs[t]) / len(later_runs[t]) for t in both]
        warm_up = {
            "tests": len(both),
            "first_mean_s": sum(first) / len(first),
            "later_mean_s": sum(later) / len(later),
        }
    ran = [(source, a) for source, a in attempts if a.started is not None]
    slowest = sorted(ran, key=lambda sa: -sa[1].run_s)[: max(0, top)]
    return {
        "span_s": sum(r.end - r.start for r in runs),
        "runs": len(runs),
        "tasks": len(attempts),
        "outcomes": _count(a.outcome.split(":")[0] for _, a in attempts),
        "groups": groups,
        "spawning_s": spawning,
        "waits": {
            spec: {"tasks": len(w), "total_s": sum(w), "mean_s": sum(w) / len(w), "max_s": max(w)}
            for spec, w in sorted(waits.items())
        },
        "slowest": [
            {
                "run": source,
                "test": a.test,
                "run_s": a.run_s,
                "wait_s": a.wait_s,
                "outcome": a.outcome,
                "first_task_on_group": a.first,
            }
            for source, a in slowest
        ],
        "idle": [
            g for g in groups if g["busy_share"] < IDLE_SHARE and (g["ready_s"] > 0 or g["tasks"])
        ],
        "warm_up": warm_up,
    }


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        out[value] = out.get(value, 0) + 1
    return out
