"""Placement as a table and as properties (issue 29): snapshots in, decisions out.

Each scenario is one :class:`~cpq.broker.placement.view.Snapshot` and the decisions it must
give, in words a reviewer can check against docs/design.md "Placement". The properties run
the placement on random snapshots and check what must hold whatever the snapshot: never
two groups on one GPU, never beyond a budget, a busy group never interrupted, the oldest
CPU task first; and, on the broker (fakes), that a repeating sequence of mixed world sizes
reaches a steady state where no group starts. ``tools/mutants.py`` breaks each one.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cpq.broker.placement.decisions import Decision, Run, Start, Stop, WantGpus, Yield
from cpq.broker.placement.history import History
from cpq.broker.placement.steps import Steps
from cpq.broker.placement.view import (
    DEFAULT_RANK_MB,
    Bounds,
    GroupView,
    Queued,
    QueueView,
    Room,
    Snapshot,
    Want,
)
from cpq.protocol import PoolSpec

from .fakes import Sim, spec

GPU4 = Room(gpus=("0", "1", "2", "3"), max_ranks=8, memory_mb=0.0)
CPU = Room(max_ranks=4, memory_mb=2000.0)
NOW = 100.0


def gspec(ws: int, name: str = "") -> PoolSpec:
    return spec(ws, env=[("SPEC", name)] if name else ())


def group(
    gid: str, pool: PoolSpec, state: str = "idle", gpus: tuple[str, ...] = (), **kw: Any
) -> GroupView:
    cpu = not gpus
    memory = kw.pop("memory_mb", DEFAULT_RANK_MB * pool.world_size if cpu else 0.0)
    return GroupView(gid, pool, state, gpus, cpu=cpu, memory_mb=memory, **kw)


def queue(pool: PoolSpec, count: int, oldest: float = 90.0, **kw: Any) -> QueueView:
    tasks = tuple(Queued(f"{pool.world_size}-{i}", session="s", **kw) for i in range(count))
    return QueueView(pool, tasks, count, oldest)


def snap(
    groups: list[GroupView],
    queues: list[QueueView] = (),  # type: ignore[assignment]
    room: Room = GPU4,
    **kw: Any,
) -> Snapshot:
    kw.setdefault("history", History())
    kw.setdefault("bounds", Bounds(spares=0))
    return Snapshot(NOW, 1000.0 + NOW, room, tuple(groups), tuple(queues), **kw)


def words(decisions: list[Decision]) -> list[tuple[Any, ...]]:
    """Decisions as short tuples: what a scenario lists."""
    out: list[tuple[Any, ...]] = []
    for d in decisions:
        if isinstance(d, Run):
            out.append(("run", d.task, d.group))
        elif isinstance(d, Start):
            out.append(("start", d.spec.world_size, d.gpus, "spare" if d.spare else "task"))
        elif isinstance(d, Stop):
            out.append(("stop", d.group, d.cause))
        elif isinstance(d, Yield):
            out.append(("yield", d.group))
        elif isinstance(d, WantGpus):
            out.append(("want", d.spec.world_size, d.need, tuple(sorted(d.gpus))))
    return out


def decide(snapshot: Snapshot) -> list[tuple[Any, ...]]:
    return words(Steps().decide(snapshot))


A, B = gspec(2, "a"), gspec(2, "b")


def test_an_idle_group_takes_the_queued_task() -> None:
    assert decide(snap([group("g1", A, gpus=("0", "1"))], [queue(A, 1)])) == [("run", "2-0", "g1")]


def test_the_group_that_ran_the_key_is_preferred_and_a_spare_comes_last() -> None:
    history = History()
    history.used(A, 50.0, b"c", "k", "g2")
    groups = [
        group("g1", A, gpus=("0", "1"), last_used=80.0),
        group("g2", A, gpus=("2", "3"), last_used=60.0),
    ]
    assert decide(snap(groups, [queue(A, 1, affinity="k")], history=history)) == [
        ("run", "2-0", "g2")
    ]
    spare_first = [group("s", A, gpus=("0", "1"), spare=True), group("g", A, gpus=("2", "3"))]
    assert decide(snap(spare_first, [queue(A, 1)], history=history)) == [("run", "2-0", "g")]
    fresh = snap(spare_first, [queue(A, 1, fresh=True)], history=history)
    assert decide(fresh) == [("run", "2-0", "s")]


def test_a_spec_without_a_group_starts_one_on_free_gpus() -> None:
    groups = [group("g1", B, "busy", ("0", "1"))]
    assert decide(snap(groups, [queue(A, 1)])) == [("start", 2, ("2", "3"), "task")]


def test_gpus_short_an_idle_group_of_another_spec_goes_and_a_busy_one_never() -> None:
    full = [group("g1", B, "idle", ("0", "1")), group("g2", gspec(2, "c"), "busy", ("2", "3"))]
    assert decide(snap(full, [queue(A, 1)])) == [("stop", "g1", "evicted")]
    busy = [dataclasses.replace(full[0], state="busy"), full[1]]
    assert decide(snap(busy, [queue(A, 1)])) == []


def test_gpus_held_by_another_broker_are_wanted_and_not_tried_again_at_once() -> None:
    s = snap([], [queue(gspec(4), 1)], held_elsewhere=frozenset({"2", "3"}))
    assert decide(s) == [("want", 4, 2, ("2", "3"))]


def test_an_idle_group_yields_to_an_older_want_and_keeps_its_gpus_for_an_own_older_one() -> None:
    want = Want("other", since=1000.0, need=2, gpus=frozenset({"0", "1"}), who="bob")
    groups = [group("g1", B, "idle", ("0", "1"))]
    assert decide(snap(groups, foreign=(want,))) == [("yield", "g1")]
    # this broker's own task (all 4 GPUs, two held elsewhere) waits since 990, before 1000
    mine = snap(
        groups,
        [queue(gspec(4), 1, oldest=-10.0)],
        foreign=(want,),
        held_elsewhere=frozenset({"2", "3"}),
    )
    assert ("yield", "g1") not in decide(mine)


def test_cpu_idle_groups_hold_memory_and_busy_ones_cores() -> None:
    one, two, four = gspec(1), gspec(2), gspec(4)
    warm = [group("g1", one), group("g2", two), group("g4", four)]  # 2800 MB of 2000? see room
    room = dataclasses.replace(CPU, memory_mb=3000.0)
    for pool, gid in ((one, "g1"), (two, "g2"), (four, "g4")):
        assert decide(snap(warm, [queue(pool, 1)], room)) == [("run", f"{pool.world_size}-0", gid)]
    busy = [dataclasses.replace(warm[0], state="busy"), *warm[1:]]  # 1 of 4 cores busy
    assert decide(snap(busy, [queue(four, 1)], room)) == []  # waits for the core, no start


def test_a_wide_task_waiting_for_cores_is_not_passed_by_a_narrow_one() -> None:
    """The ws=4 task (queued first) waits for the core the busy ws=1 group holds; the ws=1
    task queued after it does not take a core first (a stream of small tests would starve
    the wide one)."""
    one, four = gspec(1), gspec(4)
    groups = [group("busy", gspec(1, "x"), "busy"), group("g4", four), group("g1", one)]
    room = dataclasses.replace(CPU, memory_mb=8000.0)
    queues = [queue(four, 1, oldest=1.0), queue(one, 1, oldest=2.0)]
    assert decide(snap(groups, queues, room)) == []


def test_cpu_memory_full_the_least_recently_used_idle_group_goes_saying_why() -> None:
    groups = [group("old", A, last_used=10.0), group("new", B, last_used=50.0)]
    room = dataclasses.replace(CPU, memory_mb=1900.0)
    decisions = Steps().decide(snap(groups, [queue(gspec(1), 1)], room))
    assert words(decisions) == [("stop", "old", "evicted")]
    (stop,) = decisions
    assert isinstance(stop, Stop)
    assert stop.why == (
        "evicted for a ws1/auto group: CPU groups may hold 1900 MB (--memory), 1600 MB held"
    )


def test_recycling_comes_first_and_the_task_waits_for_a_fresh_group() -> None:
    tired = group("g1", A, gpus=("0", "1"), tasks_done=3)
    s = snap([tired], [queue(A, 1)], bounds=Bounds(spares=0, max_tasks_per_group=3))
    assert decide(s) == [("stop", "g1", "recycled"), ("start", 2, ("2", "3"), "task")]


def test_idle_groups_beyond_the_most_recently_used_one_are_released_after_idle_release() -> None:
    bounds = Bounds(spares=0, idle_release_s=100.0)
    recent = group("g1", A, gpus=("0", "1"), last_used=NOW - 500.0)
    old = group("g2", A, gpus=("2", "3"), last_used=NOW - 600.0)
    young = group("g3", A, last_used=NOW - 50.0, spare=False)
    # g1 is its spec's most recently used idle group of the two old ones: it stays
    assert decide(snap([recent, old], bounds=bounds)) == [("stop", "g2", "recycled")]
    # the idle time counts, not the order; 0 is never; a busy or another spec's group never
    assert decide(snap([young, old], bounds=bounds)) == [("stop", "g2", "recycled")]
    assert decide(snap([young, recent], bounds=Bounds(spares=0, idle_release_s=0))) == []
    busy = group("g4", A, "busy", last_used=NOW - 900.0)
    other = group("g6", B, last_used=NOW - 900.0)
    assert decide(snap([recent, busy, other], bounds=bounds)) == []


def test_a_spare_starts_for_a_used_spec_only_when_nothing_is_queued() -> None:
    history = History()
    history.used(A, NOW, b"c", "", "g1")
    groups = [group("g1", A, gpus=("0", "1"))]
    bounds = Bounds(spares=1)
    assert decide(snap(groups, history=history, bounds=bounds)) == [
        ("start", 2, ("2", "3"), "spare")
    ]
    queued = snap(groups, [queue(B, 2)], history=history, bounds=bounds)
    assert ("start", 2, ("2", "3"), "spare") not in decide(queued)


def test_warming_fills_free_room_only() -> None:
    groups = [group("g1", B, "idle", ("0", "1"))]
    assert decide(snap(groups, warm=((A, 3),))) == [("start", 2, ("2", "3"), "task")]


# --------------------------------------------------------------------------- properties

SPECS = [gspec(1), gspec(2), gspec(4), gspec(2, "x")]


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    """A valid snapshot: GPU groups on disjoint GPUs (or CPU groups), random states, random
    queues, random other brokers' holdings."""
    on_gpus = draw(st.booleans())
    room = (
        GPU4
        if on_gpus
        else Room(
            max_ranks=draw(st.sampled_from([2, 4, 8])),
            memory_mb=draw(st.sampled_from([0.0, 1000.0, 4000.0])),
        )
    )
    free = list(room.gpus)
    groups = []
    for n in range(draw(st.integers(0, 4))):
        pool = draw(st.sampled_from(SPECS))
        state = draw(st.sampled_from(["starting", "idle", "busy", "stopping"]))
        gpus: tuple[str, ...] = ()
        if on_gpus:
            if len(free) < pool.world_size:
                continue
            gpus, free = tuple(free[: pool.world_size]), free[pool.world_size :]
        spare = state in ("starting", "idle") and draw(st.booleans())
        last = draw(st.floats(0.0, NOW))
        groups.append(group(f"g{n}", pool, state, gpus, spare=spare, last_used=last, ready_at=last))
    queues = []
    for n, pool in enumerate(draw(st.lists(st.sampled_from(SPECS), unique=True, max_size=3))):
        queues.append(queue(pool, draw(st.integers(1, 3)), oldest=float(n)))
    held = frozenset(draw(st.lists(st.sampled_from(free), unique=True))) if free else frozenset()
    history = History()
    for pool in draw(st.lists(st.sampled_from(SPECS), unique=True)):
        history.used(pool, NOW - 1, b"c", "", "")
    bounds = Bounds(spares=draw(st.sampled_from([0, 1])), scale_up_after_s=0.0)
    return snap(groups, queues, room, held_elsewhere=held, history=history, bounds=bounds)


def after(snapshot: Snapshot, decisions: list[Decision]) -> dict[str, GroupView]:
    """The groups once ``decisions`` are carried out (written apart from the plan)."""
    groups = {g.id: g for g in snapshot.groups}
    for n, d in enumerate(decisions):
        if isinstance(d, Run):
            groups[d.group] = dataclasses.replace(groups[d.group], state="busy")
        elif isinstance(d, Start):
            cpu = not snapshot.room.uses_gpus(d.spec)
            memory = DEFAULT_RANK_MB * d.spec.world_size if cpu else 0.0
            groups[f"new{n}"] = GroupView(
                f"new{n}", d.spec, "starting", d.gpus, d.spare, cpu, memory
            )
        elif isinstance(d, Stop | Yield):
            groups[d.group] = dataclasses.replace(groups[d.group], state="stopping")
    return groups


@settings(max_examples=300, deadline=None)
@given(snapshots())
def test_never_two_groups_on_one_gpu(snapshot: Snapshot) -> None:
    decisions = Steps().decide(snapshot)
    held = Counter(gpu for g in after(snapshot, decisions).values() for gpu in g.gpus)
    assert all(count == 1 for count in held.values()), (words(decisions), held)
    started = {gpu for d in decisions if isinstance(d, Start) for gpu in d.gpus}
    assert not started & snapshot.held_elsewhere  # nor on one another broker holds


@settings(max_examples=300, deadline=None)
@given(snapshots())
def test_never_beyond_a_budget(snapshot: Snapshot) -> None:
    decisions = Steps().decide(snapshot)
    room = snapshot.room
    before = sum(g.ranks for g in snapshot.groups if g.cpu and g.state == "busy")
    busy = sum(g.ranks for g in after(snapshot, decisions).values() if g.cpu and g.state == "busy")
    assert busy <= max(before, room.max_ranks), words(decisions)
    held = sum(g.memory_mb for g in snapshot.groups if g.cpu)
    for d in decisions:  # a CPU start fits --memory, or runs alone
        if isinstance(d, Start) and not room.uses_gpus(d.spec):
            need = DEFAULT_RANK_MB * d.spec.world_size
            assert held + need <= room.memory_mb or held <= 0, words(decisions)
            held += need


@settings(max_examples=300, deadline=None)
@given(snapshots())
def test_a_busy_group_is_never_interrupted(snapshot: Snapshot) -> None:
    decisions = Steps().decide(snapshot)
    state = {g.id: g for g in snapshot.groups}
    for d in decisions:
        if isinstance(d, Stop | Yield):
            victim = state[d.group]
            assert victim.state == "idle" or (victim.spare and victim.state == "starting"), d


@settings(max_examples=300, deadline=None)
@given(snapshots())
def test_the_oldest_cpu_task_takes_cores_first(snapshot: Snapshot) -> None:
    """A CPU task that waits for cores with an idle group of its spec ready is not passed by
    a younger CPU task."""
    if snapshot.room.gpus:
        return
    decisions = Steps().decide(snapshot)
    final = after(snapshot, decisions)
    ran = Counter(d.spec for d in decisions if isinstance(d, Run))
    for i, older in enumerate(snapshot.queues):
        left = older.depth - ran[older.spec]
        idle = [g for g in final.values() if g.spec == older.spec and g.state == "idle"]
        if left and idle:  # it waited for cores
            younger = {q.spec for q in snapshot.queues[i + 1 :]}
            assert not [d for d in decisions if isinstance(d, Run) and d.spec in younger]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 4]), min_size=2, max_size=9), st.sampled_from([0, 1]))
def test_a_repeating_mix_of_world_sizes_reaches_a_state_where_no_group_starts(
    sizes: list[int], spares: int
) -> None:
    """One session's tests of mixed world sizes on a 2-core box's default budget
    (--max-ranks 4, memory for every group): the second round starts no group."""
    sim = Sim(max_ranks=4, memory_mb=8000.0, spares=spares)
    sim.client()

    def one_round() -> None:
        for ws in sizes:
            task = sim.submit(pool_spec=spec(ws))
            for _ in range(5):
                for group in list(sim.broker.pools.groups.values()):
                    if group.state == "starting":
                        sim.bring_up(group.id)
                running = [g for g in sim.broker.pools.groups if sim.running(g) == task]
                if running:
                    break
                sim.tick(0.05)
            (group_id,) = running
            sim.finish_all(group_id, task)
        sim.tick(0.05)
        for group in list(sim.broker.pools.groups.values()):
            if group.state == "starting":
                sim.bring_up(group.id)

    one_round()
    started = sim.broker.totals.groups_started
    one_round()
    assert sim.broker.totals.groups_started == started


def test_a_sessions_next_test_goes_where_its_tests_ran() -> None:
    """Its affinity key points at another idle group (a test of that name ran there in an
    earlier session): the session's own group serves, so what one test left reaches the
    next as in one pytest process (found by a newcomer: a default dtype not carried)."""
    from cpq import protocol
    from cpq.broker.placement.affinity import pick_idle
    from cpq.broker.placement.view import GroupView

    spec1 = protocol.PoolSpec(world_size=2, python="python", roots=["/p"], backend="gloo")
    earlier = GroupView("g1", spec1, "idle", last_used=5.0, sessions=frozenset({"s-old"}))
    home = GroupView("g2", spec1, "idle", last_used=3.0, sessions=frozenset({"s-old", "s-now"}))
    assert pick_idle([earlier, home], "g1", False, None, "s-now") is home
    # a session's first test: the key's group, as before
    assert pick_idle([earlier, home], "g1", False, None, "s-new") is earlier
