"""Dispatch first (``cpq.broker.placement.express``): where it picks a group for the one
queued task, the whole placement runs that task on the same group; and in the plain case of
a warm group it does pick (else the fast path would be dead code and the test of it empty).

On random snapshots: idle, busy and spare groups of two specs with random ages, sessions,
tasks done and unfit ranks, CPU and GPU rooms, affinity keys, bounds. On the broker (fakes):
a submit to a warm group is dispatched before the placement that follows it runs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpq.broker.placement import express
from cpq.broker.placement.decisions import Run
from cpq.broker.placement.history import History
from cpq.broker.placement.steps import Steps
from cpq.broker.placement.view import Bounds, GroupView, Queued, QueueView, Room, Snapshot

from .fakes import Sim, spec

NOW = 1000.0
SPECS = (spec(2), spec(2, env=[("SPEC", "other")]))


def group_views(draw: st.DrawFn, gpus: bool) -> list[GroupView]:
    views = []
    free = [str(n) for n in range(10)]  # two for each of up to five groups
    for number in range(draw(st.integers(0, 5))):  # mostly idle groups of the task's spec
        pool = SPECS[draw(st.sampled_from([0, 0, 0, 1]))]
        state = draw(
            st.sampled_from(["idle", "idle", "idle", "idle", "busy", "starting", "stopping"])
        )
        held = tuple(free.pop() for _ in range(2)) if gpus else ()
        views.append(
            GroupView(
                f"g{number}",
                pool,
                state,
                held,
                spare=draw(st.sampled_from([False, False, False, True])),
                cpu=not gpus,
                memory_mb=0.0 if gpus else 800.0,
                last_used=NOW - draw(st.sampled_from([0.0, 5.0, 50.0, 2000.0])),
                sessions=frozenset(draw(st.sets(st.sampled_from(["s1", "s2"])))),
                tasks_done=draw(st.integers(0, 12)),
                unfit=((0, "few descriptors"),) if draw(st.integers(0, 9)) == 0 else (),
            )
        )
    return views


@st.composite
def scenes(draw: st.DrawFn) -> tuple[Snapshot, Queued]:
    gpus = draw(st.booleans())
    room = (
        Room(gpus=tuple(str(n) for n in range(10)), max_ranks=8)
        if gpus
        else Room(max_ranks=4, memory_mb=9e9)
    )
    groups = group_views(draw, gpus)
    history = History()
    key = draw(st.sampled_from(["", "k1"]))
    if key and groups:
        history.used(SPECS[0], NOW - 1, b"c", key, draw(st.sampled_from(groups)).id)
    task = Queued("t1", b"c", draw(st.sampled_from(["s1", "s2", "s3"])), key)
    bounds = Bounds(
        spares=draw(st.integers(0, 1)),
        max_tasks_per_group=draw(st.sampled_from([0, 10])),
        idle_release_s=draw(st.sampled_from([0.0, 900.0])),
    )
    queue = QueueView(SPECS[0], (task,), 1, NOW - 0.001)
    return Snapshot(NOW, NOW, room, tuple(groups), (queue,), history, bounds), task


def pick(snapshot: Snapshot, task: Queued) -> GroupView | None:
    """What the broker's :meth:`Placer.express` asks of the policy for this snapshot."""
    pool = SPECS[0]
    idle = [g for g in snapshot.groups if g.spec == pool and g.state == "idle"]
    busy = sum(g.ranks for g in snapshot.groups if g.cpu and g.state == "busy")
    cores_left = None if snapshot.room.uses_gpus(pool) else snapshot.room.max_ranks - busy
    preferred = snapshot.history.group_for(pool, task.affinity)
    return express.pick(idle, preferred, task.session, NOW, snapshot.bounds, cores_left)


@settings(max_examples=400, deadline=None)
@given(scenes())
def test_where_express_picks_the_whole_placement_runs_the_task_there(
    scene: tuple[Snapshot, Queued],
) -> None:
    snapshot, task = scene
    chosen = pick(snapshot, task)
    if chosen is None:
        return
    runs = [d for d in Steps().decide(snapshot) if isinstance(d, Run)]
    assert [(r.task, r.group) for r in runs] == [(task.key, chosen.id)]


def test_a_warm_group_is_picked() -> None:
    warm = GroupView("g1", SPECS[0], "idle", last_used=NOW - 1, sessions=frozenset({"s1"}))
    snapshot = Snapshot(NOW, NOW, Room(max_ranks=4), (warm,), (), History(), Bounds())
    assert pick(snapshot, Queued("t1", b"c", "s1")) == warm


def test_a_cpu_task_without_cores_is_left_to_the_whole_placement() -> None:
    warm = GroupView("g1", SPECS[0], "idle", last_used=NOW - 1, sessions=frozenset({"s1"}))
    busy = tuple(GroupView(f"b{i}", SPECS[1], "busy", last_used=NOW) for i in range(2))
    task = Queued("t1", b"c", "s1")
    queue = QueueView(SPECS[0], (task,), 1, NOW - 0.001)
    snapshot = Snapshot(NOW, NOW, Room(max_ranks=4), (warm, *busy), (queue,), History(), Bounds())
    assert Steps().decide(snapshot) == [] and pick(snapshot, task) is None
    roomy = Snapshot(NOW, NOW, Room(max_ranks=6), (warm, *busy), (queue,), History(), Bounds())
    assert pick(roomy, task) == warm


def test_a_submit_to_a_warm_group_goes_out_before_the_placement_after_it() -> None:
    sim = Sim(spares=1)
    sim.client()
    first = sim.submit()
    sim.bring_up("g1")
    sim.finish_all("g1", first)
    sim.bring_up("g2")  # the spare
    order: list[str] = []
    placer = sim.broker.placer
    place = placer.place
    placer.place = lambda closing: (order.append("placement"), place(closing))[1]  # type: ignore[method-assign]
    sent = sim.broker.tasks.send_rank
    sim.broker.tasks.send_rank = lambda identity, frame: (
        order.append("dispatch"),
        sent(identity, frame),
    )[1]  # type: ignore[method-assign]
    task = sim.submit()
    assert sim.broker.pools.groups["g1"].task is not None
    assert order[:3] == ["dispatch", "dispatch", "placement"], order
    sim.finish_all("g1", task)
    assert sim.done()[task].outcome == "passed"


def queued_beside_a_warm_group(**fields: Any) -> Sim:
    """A broker with g1 warm and idle, and one task queued that no placement saw yet."""
    sim = Sim(spares=0)
    sim.client()
    first = sim.submit()
    sim.bring_up("g1")
    sim.finish_all("g1", first)
    schedule = sim.broker.schedule
    sim.broker.schedule = lambda: None  # type: ignore[method-assign]
    sim.submit(**fields)
    sim.broker.schedule = schedule  # type: ignore[method-assign]
    assert len(sim.broker.tasks.queues) == 1 and sim.broker.pools.groups["g1"].task is None
    return sim


def test_the_plain_case_goes_first() -> None:
    sim = queued_beside_a_warm_group()
    assert sim.broker.placer.express(closing=False)
    assert sim.broker.pools.groups["g1"].task is not None


@pytest.mark.parametrize(
    "guard",
    ["closing", "warm request", "another task", "reserved group", "foreign want", "own groups",
     "bounced task"],
)  # fmt: skip
def test_what_is_not_plain_goes_to_the_whole_placement(guard: str) -> None:
    sim = queued_beside_a_warm_group(own_groups=guard == "own groups")
    broker = sim.broker
    if guard == "warm request":
        broker.placer.requests.warm.append((spec(), 1))
    elif guard == "another task":
        broker.tasks.queues.push(next(iter(broker.tasks.queues)))
    elif guard == "reserved group":
        broker.pools.groups["g1"].reserved_for = "some task"
    elif guard == "foreign want":
        broker.pools.sharing = SimpleNamespace(foreign=[object()])  # type: ignore[assignment]
    elif guard == "bounced task":
        next(iter(broker.tasks.queues)).stale_bounces = 1
    assert not broker.placer.express(closing=guard == "closing")
    assert broker.pools.groups["g1"].task is None
