"""Clean spare groups and affinity (issue 15): the broker on fakes.

A spare is a group that has run no task; one is kept per recently used spec, used last,
evicted first, and takes the next task at once when a group must be replaced.
"""

from __future__ import annotations

import pytest

from cpq import protocol
from cpq.broker.placement.history import RETRY_AFTER_S, History
from cpq.client.plugin import default_affinity

from .fakes import Sim, spec

FEATURES = sorted(protocol.ALL_FEATURES)


def warm_with_spare(**config: object) -> tuple[Sim, str]:
    """A broker whose spec ran one task on g1 and whose spare g2 is up (idle)."""
    sim = Sim(spares=1, **config)
    sim.client(features=FEATURES)
    task = sim.submit()
    sim.bring_up("g1")
    assert sim.running("g1") == task
    sim.tick(0.05)  # the spec is in use: a spare starts in the background
    assert sim.states() == {"g1": "busy", "g2": "starting"}
    assert sim.broker.pools.groups["g2"].spare
    sim.bring_up("g2")
    sim.finish_all("g1", task)
    assert sim.states() == {"g1": "idle", "g2": "idle"}
    return sim, task


def spares_of(sim: Sim) -> list[str]:
    return [g.id for g in sim.broker.pools.groups.values() if g.spare]


def test_a_used_spec_gets_one_spare_and_tasks_go_to_used_groups_first() -> None:
    sim, _ = warm_with_spare()
    for _ in range(3):
        task = sim.submit()
        assert sim.running("g1") == task  # the used group: its imports are warm
        sim.tick(0.05)
        assert spares_of(sim) == ["g2"]  # one spare, however many tasks
        sim.finish_all("g1", task)
    status = sim.broker.status()
    assert {p["id"]: p["spare"] for p in status["pools"]} == {"g1": False, "g2": True}
    assert {p["id"]: p["state"] for p in status["pools"]} == {"g1": "idle", "g2": "idle"}


def test_no_spare_without_the_option() -> None:
    sim = Sim(spares=0)
    sim.client()
    task = sim.submit()
    sim.bring_up("g1")
    sim.tick(1.0)
    sim.finish_all("g1", task)
    sim.tick(1.0)
    assert sim.states() == {"g1": "idle"}


def test_a_recycled_group_is_replaced_by_the_spare_at_once() -> None:
    sim, _ = warm_with_spare(failure_grace_s=1.0)
    failing = sim.submit()
    sim.report("g1", 0, failing, "failed")  # rank 1 never reports: stuck, g1 is recycled
    sim.tick(1.1)
    sim.stacks("g1", 1, failing, "stuck in all_reduce")
    assert sim.done()[failing].outcome == "failed"
    assert sim.states()["g1"] == "stopping"
    following = sim.submit()
    assert sim.running("g2") == following  # no spawn to wait for
    assert not sim.broker.pools.groups["g2"].spare
    sim.tick(0.05)  # g1 is reaped; a new spare starts in the background
    assert spares_of(sim) == ["g3"] and sim.states()["g3"] == "starting"


@pytest.mark.parametrize("unfit", ["rss", "tasks"])
def test_a_group_recycled_by_a_bound_is_replaced_by_the_spare(unfit: str) -> None:
    bounds = {"max_rss_growth_mb": 50.0} if unfit == "rss" else {"max_tasks_per_group": 2}
    sim, _ = warm_with_spare(**bounds)
    task = sim.submit()
    for rank in (0, 1):
        sim.report("g1", rank, task, rss_mb=500.0 if unfit == "rss" else 100.0)
    assert sim.states()["g1"] == "stopping"
    assert sim.running("g2") is None
    following = sim.submit()
    assert sim.running("g2") == following


def test_changed_code_sends_the_task_to_the_spare_even_past_other_used_groups() -> None:
    sim, _ = warm_with_spare(max_ranks=8)
    # A second used group g3: two tasks at once, the second takes the spare g2 and g3
    # becomes the new spare, which then serves a third.
    a, b = sim.submit(), sim.submit()
    assert sim.running("g1") == a and sim.running("g2") == b
    sim.tick(0.05)
    sim.bring_up("g3")
    c = sim.submit()
    assert sim.running("g3") == c
    for group_id, task in (("g1", a), ("g2", b), ("g3", c)):
        sim.finish_all(group_id, task)
        sim.tick(0.01)
    sim.tick(0.05)
    assert spares_of(sim) == ["g4"]
    sim.bring_up("g4")
    edited = sim.submit()
    assert sim.running("g3") == edited  # the most recently used group
    result = protocol.RankResult(rank=0, outcome="error")
    stale = protocol.RankDone(
        task_id=edited, result=result, stale="/project/helper.py", stale_kind="code"
    )
    sim.rank_send(sim.rank_id("g3", 0), stale)
    assert sim.states()["g3"] == "stopping"
    # g1 and g2 loaded the same helper: the task goes to the spare, which loaded none.
    assert sim.running("g4") == edited
    sim.finish_all("g4", edited)
    assert sim.done()[edited].outcome == "passed"
    assert sim.done()[edited].groups == ["g4"]


def test_no_spare_starts_while_tasks_are_queued() -> None:
    sim = Sim(spares=1, memory_mb=300.0)  # room for one measured ws=2 group (200 MB)
    sim.client()
    first, second = sim.submit(), sim.submit()
    sim.bring_up("g1")
    assert sim.running("g1") == first
    sim.tick(0.5)
    assert sim.states() == {"g1": "busy"}  # no room anyway, and `second` waits
    sim.finish_all("g1", first)
    assert sim.running("g1") == second
    sim.tick(0.05)
    assert sim.states() == {"g1": "busy"}  # no free memory: no spare


def test_a_spare_never_blocks_a_queued_task_of_another_spec() -> None:
    sim, _ = warm_with_spare(memory_mb=450.0)  # g1 (used) + g2 (spare) hold the memory
    other = sim.submit(pool_spec=spec(2, env=[("B", "1")]))
    assert sim.states()["g2"] == "stopping"  # the spare goes first, not the used g1
    assert sim.states()["g1"] == "idle"
    assert "evicted for" in sim.broker.pools.groups["g2"].stop_reason
    sim.tick(0.05)  # reaped: its memory comes back and the other spec's group starts
    assert sim.states()["g3"] == "starting"
    sim.bring_up("g3")
    assert sim.running("g3") == other


def test_a_starting_spare_is_evicted_for_a_growing_spec() -> None:
    """A spec that already has a group may still evict another spec's spare to grow."""
    sim = Sim(spares=1, memory_mb=650.0, scale_up_after_s=1.0)  # three ws=2 groups
    sim.client(features=FEATURES)
    a_spec, b_spec = spec(2, env=[("A", "1")]), spec(2, env=[("B", "1")])
    a = sim.submit(pool_spec=a_spec)
    sim.bring_up("g1")
    sim.tick(0.05)
    assert spares_of(sim) == ["g2"]  # A's spare, starting
    b1 = sim.submit(pool_spec=b_spec)
    sim.bring_up("g3")
    assert sim.running("g3") == b1
    b2 = sim.submit(pool_spec=b_spec)  # waits: g3 busy, no room for a second B group
    sim.processes["g2"].gone_after_terminate = False
    sim.tick(1.1)
    assert sim.states()["g2"] == "stopping"  # A's spare made room for B to grow
    assert "evicted for" in sim.broker.pools.groups["g2"].stop_reason
    sim.processes["g2"].gone_after_terminate = True
    sim.tick(0.05)
    assert sim.states()["g4"] == "starting"
    sim.bring_up("g4")
    assert sim.running("g4") == b2
    sim.finish_all("g1", a)


def test_spares_are_evicted_before_idle_used_groups() -> None:
    sim = Sim(spares=1, memory_mb=650.0)
    sim.client()
    a = sim.submit(pool_spec=spec(2, env=[("A", "1")]))
    sim.bring_up("g1")
    sim.finish_all("g1", a)
    sim.tick(0.05)
    sim.bring_up("g2")  # A's spare
    b = sim.submit(pool_spec=spec(2, env=[("B", "1")]))
    sim.bring_up("g3")
    sim.finish_all("g3", b)
    sim.tick(0.05)
    assert sim.states() == {"g1": "idle", "g2": "idle", "g3": "idle"}  # no room for B's
    c = sim.submit(pool_spec=spec(2, env=[("C", "1")]))
    assert sim.states()["g2"] == "stopping"
    assert sim.states()["g1"] == "idle" and sim.states()["g3"] == "idle"
    sim.tick(0.05)
    sim.bring_up("g4")
    assert sim.running("g4") == c


def test_the_spare_of_a_spec_no_longer_used_is_stopped() -> None:
    sim, _ = warm_with_spare(spare_window_s=30.0)
    sim.tick(29.0)
    assert sim.states()["g2"] == "idle"
    sim.processes["g2"].gone_after_terminate = False
    sim.tick(2.0)
    assert sim.states()["g2"] == "stopping"
    assert "spare unused" in sim.broker.pools.groups["g2"].stop_reason
    assert "g3" not in sim.states()
    assert sim.broker.totals.groups_recycled == 0  # not a replacement


def test_a_failing_spare_is_not_restarted_in_a_loop() -> None:
    sim = Sim(spares=1, start_timeout_s=5.0)
    sim.client()
    task = sim.submit()
    sim.fail_next_start = True  # the spare starts once the spec's first task is out
    sim.bring_up("g1")
    sim.tick(0.05)  # the spare could not start (no such interpreter)
    assert "g2" in sim.processes and sim.states().get("g2") in (None, "stopping")
    sim.tick(5.0)
    assert set(sim.processes) == {"g1", "g2"}  # backing off
    sim.finish_all("g1", task)
    assert sim.done()[task].outcome == "passed"  # the spare's failure touched no task
    for _ in range(int(RETRY_AFTER_S)):  # the spec stays in use within its window
        t = sim.submit()
        sim.finish_all("g1", t)
        sim.tick(1.0)
    assert "g3" in sim.processes  # after the back-off, a spare again


# --------------------------------------------------------------------------- affinity


def two_idle_groups() -> Sim:
    sim = Sim(spares=0, max_ranks=4, scale_up_after_s=0.0)
    sim.client(features=FEATURES)
    a, b = sim.submit(affinity="k1"), sim.submit(affinity="k2")
    sim.bring_up("g1")
    sim.tick(0.05)
    sim.bring_up("g2")
    assert sim.running("g1") == a and sim.running("g2") == b
    sim.finish_all("g2", b)
    sim.finish_all("g1", a)  # g1 is now the most recently used
    return sim


def test_a_task_prefers_the_idle_group_that_last_ran_its_key() -> None:
    sim = two_idle_groups()
    task = sim.submit(affinity="k2")
    assert sim.running("g2") == task  # not g1, the most recently used
    sim.finish_all("g2", task)
    task = sim.submit(affinity="k1")
    assert sim.running("g1") == task


def test_without_a_key_or_a_match_the_most_recently_used_group_serves() -> None:
    sim = two_idle_groups()
    task = sim.submit()
    assert sim.running("g1") == task
    sim.finish_all("g1", task)
    sim.finish_all("g1", task)
    task = sim.submit(affinity="never-seen")
    assert sim.running("g1") == task


def test_affinity_never_makes_a_task_wait_for_its_busy_group() -> None:
    sim = two_idle_groups()
    blocker = sim.submit(affinity="k2")
    assert sim.running("g2") == blocker
    task = sim.submit(affinity="k2")
    assert sim.running("g1") == task  # g2 is busy: the idle one serves at once


def test_affinity_remembers_the_last_group_and_forgets_the_oldest_keys() -> None:
    memory = History(max_keys=2)
    ws2 = spec(2)
    memory.used(ws2, 0.0, b"c", "a", "g1")
    memory.used(ws2, 0.0, b"c", "a", "g2")
    assert memory.group_for(ws2, "a") == "g2"
    assert memory.group_for(spec(1), "a") == ""  # per spec
    memory.used(ws2, 0.0, b"c", "", "g3")
    assert memory.affinity_keys() == 1  # no key, nothing remembered
    memory.used(ws2, 0.0, b"c", "b", "g1")
    memory.used(ws2, 0.0, b"c", "a", "g3")  # "a" is the newest again
    memory.used(ws2, 0.0, b"c", "c", "g1")
    assert memory.group_for(ws2, "b") == "" and memory.group_for(ws2, "a") == "g3"


def test_an_affinity_key_is_left_out_for_a_broker_that_does_not_read_it() -> None:
    message = protocol.Submit(task_id="t", target="m:f", spec=spec(2), affinity="tests/x.py::t")
    old = protocol.unpack(protocol.encode_for(message, frozenset({"task-env"})))
    assert "affinity" not in old
    new = protocol.decode(protocol.encode_for(message, protocol.ALL_FEATURES))
    assert isinstance(new, protocol.Submit) and new.affinity == "tests/x.py::t"


@pytest.mark.parametrize(
    ("nodeid", "key"),
    [
        ("tests/test_cp.py::test_attn[bf16-2-causal]", "tests/test_cp.py::test_attn"),
        ("tests/test_cp.py::TestA::test_b[x[1]]", "tests/test_cp.py::TestA::test_b"),
        ("tests/test_cp.py::test_plain", "tests/test_cp.py::test_plain"),
    ],
)
def test_the_default_key_is_the_test_function_without_its_parameters(nodeid: str, key: str) -> None:
    assert default_affinity(nodeid) == key


def test_on_a_tight_budget_the_spare_goes_where_a_spawn_costs_the_waiting_tests_most() -> None:
    """Room for both groups and one more ws=2 group: a ws=2 spec (7 s spawns, two xdist
    workers: 14 s of waiting) and a ws=1 spec (2 s, one client) used last. The spare is the
    ws=2 one; before, the most recently used spec took the room first (a ws=1 spare), and the
    ws=2 spec, which has no spare then, paid a 7 s spawn after every edit. (Equal costs never
    trade places: test_spares_are_evicted_before_idle_used_groups.)"""
    sim = Sim(spares=1, memory_mb=550.0)  # g1 and g2, and one more ws=2 group
    one, two = spec(1), spec(2)
    for worker in (b"gw0", b"gw1"):
        sim.client(worker, features=FEATURES)
    t1 = sim.submit(client=b"gw0", pool_spec=two)
    sim.clock.advance(7.0)
    sim.bring_up("g1")
    t2 = sim.submit(client=b"gw1", pool_spec=two)  # queued behind t1
    sim.finish_all("g1", t1)
    sim.finish_all("g1", t2)
    t3 = sim.submit(client=b"gw0", pool_spec=one)  # used last
    sim.clock.advance(2.0)
    ws1 = next(g.id for g in sim.broker.pools.groups.values() if g.spec == one)
    sim.bring_up(ws1)
    sim.finish_all(ws1, t3)
    for _ in range(6):  # spares start (and would trade places) and settle
        sim.tick(0.05)
        for group in list(sim.broker.pools.groups.values()):
            if group.state == "starting":
                sim.clock.advance(7.0 if group.spec == two else 2.0)  # a spare spawns alike
                sim.bring_up(group.id)
    spares = [g for g in sim.broker.pools.groups.values() if g.spare and g.state != "stopping"]
    assert [g.spec.world_size for g in spares] == [2]
    used = {g.id for g in sim.broker.pools.groups.values() if not g.spare}
    assert used == {"g1", ws1}  # a used group is never stopped for a spare


def two_specs_used(**config: object) -> Sim:
    """A ``--max-ranks 4`` broker whose ws=1 group and ws=2 group (:func:`used_group`) each
    ran a task, whose ranks measured 100 MB at ready, and whose spares have started and come
    up (where they fit)."""
    sim = Sim(spares=1, max_ranks=4, **config)
    sim.client(features=FEATURES)
    for ws in (1, 2):
        task = sim.submit(pool_spec=spec(ws))
        sim.tick(0.05)  # a spare evicted for it is reaped: it starts
        sim.bring_up(used_group(sim, ws), rss_mb=100.0)
        sim.finish_all(used_group(sim, ws), task)
    for _ in range(3):
        sim.tick(0.05)
        for group in list(sim.broker.pools.groups.values()):
            if group.state == "starting":
                sim.bring_up(group.id, rss_mb=100.0)
    return sim


def used_group(sim: Sim, ws: int) -> str:
    """The id of the group of world size ``ws`` that is no spare."""
    groups = sim.broker.pools.groups.values()
    return next(g.id for g in groups if g.spec == spec(ws) and not g.spare)


def live_spares(sim: Sim) -> list[int]:
    groups = sim.broker.pools.groups.values()
    return sorted(g.spec.world_size for g in groups if g.spare and g.state != "stopping")


def held_mb(sim: Sim) -> float:
    return float(sim.broker.status()["broker"]["memory_used_mb"])


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(1000.0, [1, 2]), (450.0, [1]), (300.0, [])],
    ids=["both-fit", "only-the-smaller-fits", "no-room"],
)
def test_idle_groups_and_spares_cost_memory_not_cores(budget: float, expected: list[int]) -> None:
    """Issue 29: a ws=1 and a ws=2 spec on a --max-ranks 4 CPU box (cores). Idle groups hold
    no core, so their spares live within --memory (each counting its measured RSS: the used
    groups hold 300 MB), and the ws=2 spare (the most recently used spec) gives way to the
    ws=1 one only when it does not fit."""
    sim = two_specs_used(memory_mb=budget)
    assert live_spares(sim) == expected
    assert held_mb(sim) == 300.0 + 100.0 * sum(expected)
    assert sim.broker.status()["broker"]["memory_mb"] == budget


def test_a_spare_replaces_its_spec_s_group_at_once() -> None:
    sim = two_specs_used(memory_mb=1000.0)
    spare = next(g for g in sim.broker.pools.groups.values() if g.spare and g.spec == spec(2))
    g2 = used_group(sim, 2)
    edited = sim.submit(pool_spec=spec(2))
    assert sim.running(g2) == edited
    result = protocol.RankResult(rank=0, outcome="error")
    stale = protocol.RankDone(
        task_id=edited, result=result, stale="/project/helper.py", stale_kind="code"
    )
    sim.rank_send(sim.rank_id(g2, 0), stale)
    assert sim.states()[g2] == "stopping"
    assert sim.running(spare.id) == edited
    sim.tick(0.05)  # g2 reaped; a new ws=2 spare starts
    assert live_spares(sim) == [1, 2]
    sim.finish_all(spare.id, edited)
    assert sim.done()[edited].outcome == "passed"


def test_a_task_waits_for_cores_rather_than_oversubscribe_them() -> None:
    """Cores bound the ranks that run tasks: with 3 of 4 cores busy, a ws=2 task does not
    take its spec's idle spare, and no group starts for it (a new one would find no core
    either); it runs when a core comes back."""
    sim = two_specs_used(memory_mb=1000.0)
    g1, g2 = used_group(sim, 1), used_group(sim, 2)
    one = sim.submit(pool_spec=spec(1))
    first = sim.submit(pool_spec=spec(2))
    assert sim.running(g1) == one and sim.running(g2) == first
    second = sim.submit(pool_spec=spec(2))
    sim.tick(1.5)  # long enough to grow, were cores not the bound
    busy = [g for g in sim.broker.pools.groups.values() if g.state == "busy"]
    assert sum(g.spec.world_size for g in busy) == 3
    assert not [g for g in sim.broker.pools.groups.values() if g.state == "starting"]
    sim.finish_all(g2, first)
    assert sim.running(g2) == second


def test_idle_groups_never_hold_cores_and_memory_evicts_the_least_recently_used() -> None:
    """Three ws=2 specs on 4 cores all stay warm (before, the third evicted one: 6 ranks
    alive were over --max-ranks); with memory for two groups only, the third evicts the
    least recently used idle group and says which budget was short."""
    a, b, c = (spec(2, env=[(name, "1")]) for name in "ABC")
    for budget, stopped in ((10_000.0, []), (450.0, ["g1"])):
        sim = Sim(max_ranks=4, memory_mb=budget)
        sim.client(features=FEATURES)
        for group_id, which in (("g1", a), ("g2", b)):
            task = sim.submit(pool_spec=which)
            sim.bring_up(group_id, rss_mb=100.0)
            sim.finish_all(group_id, task)
        sim.submit(pool_spec=c)
        states = sim.states()
        assert [g for g, state in states.items() if state == "stopping"] == stopped
        if stopped:
            reason = sim.broker.pools.groups["g1"].stop_reason
            assert reason.startswith("evicted for a ws2/auto C=1 group: CPU groups may hold 450 MB")
            sim.tick(0.05)
        sim.bring_up("g3")
        assert sim.states()["g3"] == "busy"


def test_an_idle_rank_whose_code_changed_stops_its_group_and_the_spare_serves() -> None:
    """``RankStale`` from an idle group: stopped now (its memory is not held for code
    nobody runs), named in its stop reason; the next task runs on the spare."""
    sim, _ = warm_with_spare()
    sim.rank_send(Sim.rank_id("g1", 0), protocol.RankStale(rank=0, path="/p/helpers.py"))
    assert sim.states()["g1"] == "stopping"
    assert (
        "code changed since it started: /p/helpers.py" in sim.broker.pools.groups["g1"].stop_reason
    )
    task = sim.submit()
    assert sim.running("g2") == task


def test_a_busy_groups_stale_report_is_left_to_its_tasks_own_check() -> None:
    """A task reached the group while its report was on the way: the task's check at its
    start refuses it (a fresh group runs it); the report itself stops nothing."""
    sim, _ = warm_with_spare()
    task = sim.submit()
    busy = next(g for g, state in sim.states().items() if state == "busy")
    sim.rank_send(Sim.rank_id(busy, 0), protocol.RankStale(rank=0, path="/p/helpers.py"))
    assert sim.states()[busy] == "busy" and sim.running(busy) == task
