"""Fair queues, eviction, growth, recycling, adaptive deadlines: the broker on fakes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpq import protocol
from cpq.broker.queues import FairQueue

from .fakes import Sim, spec


class Item:
    def __init__(self, client: bytes, n: int) -> None:
        self.client, self.n, self.spec, self.queued_at = client, n, spec(1), float(n)


@given(st.lists(st.sampled_from([b"a", b"b", b"c"]), max_size=60))
def test_fair_queue_serves_clients_round_robin_and_each_in_order(clients: list[bytes]) -> None:
    queue: FairQueue[Item] = FairQueue()
    for n, client in enumerate(clients):
        queue.push(Item(client, n))
    popped = []
    while (item := queue.pop()) is not None:
        popped.append(item)
    assert sorted(i.n for i in popped) == list(range(len(clients)))
    for client in set(clients):  # each client's tasks in submit order
        mine = [i.n for i in popped if i.client == client]
        assert mine == sorted(mine)
    # Round-robin: between two tasks of one client, every client that still had tasks
    # queued was served once.
    remaining = {c: clients.count(c) for c in set(clients)}
    last_turn: dict[bytes, int] = {}
    for turn, item in enumerate(popped):
        if item.client in last_turn:
            served_since = {i.client for i in popped[last_turn[item.client] + 1 : turn]}
            waiting = {c for c, left in remaining.items() if left and c != item.client}
            assert waiting <= served_since
        last_turn[item.client] = turn
        remaining[item.client] -= 1


def test_a_busy_client_cannot_starve_another() -> None:
    sim = Sim(max_ranks=1)
    sim.client(b"busy")
    sim.client(b"late")
    mine = [sim.submit(client=b"busy", pool_spec=spec(1)) for _ in range(5)]
    other = sim.submit(client=b"late", pool_spec=spec(1))
    sim.bring_up("g1")
    order = []
    while (task := sim.running("g1")) is not None:
        order.append(task)
        sim.finish_all("g1", task)
    assert order[:3] == [mine[0], mine[1], other] or order[:2] == [mine[0], other]
    assert set(order) == {*mine, other}


# --------------------------------------------------------------------------- eviction


def test_an_idle_group_of_another_spec_is_evicted_when_gpus_are_short() -> None:
    sim = Sim(gpus=["0", "1"])
    sim.client()
    first = sim.submit(pool_spec=spec(2, env=[("A", "1")]))
    sim.bring_up("g1")
    sim.finish_all("g1", first)
    assert sim.states() == {"g1": "idle"}
    sim.processes["g1"].gone_after_terminate = False
    second = sim.submit(pool_spec=spec(2, env=[("B", "1")]))
    assert sim.states() == {"g1": "stopping"}  # evicted; its GPUs are not free yet
    assert "evicted for" in sim.broker.pools.groups["g1"].stop_reason
    sim.tick(0.05)
    assert sim.states() == {"g1": "stopping"}  # still waiting for the processes to go
    sim.processes["g1"].gone_after_terminate = True
    sim.tick(0.05)
    assert sim.states() == {"g2": "starting"}
    assert sim.processes["g2"].gpus == ["0", "1"] and sim.processes["g2"].backend == "nccl"
    sim.bring_up("g2")
    assert sim.running("g2") == second


def test_a_busy_group_is_never_evicted_and_the_task_waits() -> None:
    sim = Sim(gpus=["0", "1"])
    sim.client()
    first = sim.submit(pool_spec=spec(2, env=[("A", "1")]))
    sim.bring_up("g1")
    waiting = sim.submit(pool_spec=spec(2, env=[("B", "1")]))
    sim.tick(5)
    assert sim.states() == {"g1": "busy"}
    sim.finish_all("g1", first)
    sim.tick(0.05)
    sim.tick(0.05)
    sim.bring_up("g2")
    assert sim.running("g2") == waiting


def test_eviction_prefers_groups_whose_spec_has_nothing_queued() -> None:
    sim = Sim(gpus=["0", "1", "2"])
    sim.client()
    a, b = spec(1, env=[("A", "1")]), spec(1, env=[("B", "1")])
    for s, group in ((a, "g1"), (b, "g2")):
        task = sim.submit(pool_spec=s)
        sim.bring_up(group)
        sim.finish_all(group, task)
    sim.submit(pool_spec=spec(2, env=[("C", "1")]))
    assert sorted(sim.states().values()) == ["idle", "stopping"]  # one evicted: enough room


# --------------------------------------------------------------------------- growth


def test_a_pool_grows_once_its_oldest_task_waited_scale_up_after() -> None:
    sim = Sim(scale_up_after_s=1.0, max_ranks=8)
    sim.client()
    slow = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    queued = sim.submit(pool_spec=spec(1))
    sim.tick(0.9)
    assert list(sim.states()) == ["g1"]
    sim.tick(0.2)
    assert sim.states() == {"g1": "busy", "g2": "starting"}
    sim.tick(5)
    assert len(sim.states()) == 2  # no third group while one is starting
    sim.bring_up("g2")
    assert sim.running("g2") == queued and sim.running("g1") == slow


def test_a_pool_does_not_grow_past_the_cpu_rank_bound() -> None:
    sim = Sim(scale_up_after_s=0.5, max_ranks=2)
    sim.client()
    sim.submit(pool_spec=spec(2))
    sim.bring_up("g1")
    sim.submit(pool_spec=spec(2))
    sim.tick(3)
    assert list(sim.states()) == ["g1"]


def test_warm_starts_the_groups_asked_for_and_no_more() -> None:
    sim = Sim(max_ranks=8)
    sim.client()
    sim.client_send(b"c1", protocol.Warm(specs=[spec(2)], counts=[3]))
    sim.client_send(b"c1", protocol.Warm(specs=[spec(2)], counts=[3]))
    assert len(sim.states()) == 3
    sim.client_send(b"c1", protocol.Warm(specs=[spec(99)], counts=[1]))
    assert len(sim.states()) == 3


# --------------------------------------------------------------------------- recycling


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_a_group_is_recycled_after_max_tasks(limit: int) -> None:
    sim = Sim(max_tasks_per_group=limit)
    sim.client()
    sim.tick(0)
    sim.client_send(b"c1", protocol.Warm(specs=[spec(1)], counts=[1]))
    sim.bring_up("g1")
    sim.processes["g1"].gone_after_terminate = False
    for n in range(limit):
        task = sim.submit(pool_spec=spec(1))
        sim.finish_all("g1", task)
        expected = "stopping" if n == limit - 1 else "idle"
        assert sim.states()["g1"] == expected
    assert sim.broker.pools.groups["g1"].stop_reason == f"recycled after {limit} tasks"
    assert sim.broker.totals.groups_recycled == 1


def test_an_unfit_rank_recycles_its_group_after_the_verdict() -> None:
    sim = Sim()
    sim.client()
    task = sim.submit(pool_spec=spec(2))
    sim.bring_up("g1")
    sim.processes["g1"].gone_after_terminate = False
    sim.report("g1", 0, task)
    sim.report("g1", 1, task, unfit="has 1020 file descriptors open")
    assert sim.done()[task].outcome == "passed"
    assert sim.states() == {"g1": "stopping"}
    assert "rank 1 has 1020 file descriptors open" in sim.broker.pools.groups["g1"].stop_reason


@pytest.mark.parametrize(("growth", "recycled"), [(50.0, False), (250.0, True)])
def test_rss_growth_past_the_bound_recycles(growth: float, recycled: bool) -> None:
    sim = Sim(max_rss_growth_mb=100.0)
    sim.client()
    task = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1", rss_mb=300.0)
    sim.processes["g1"].gone_after_terminate = False
    sim.report("g1", 0, task, rss_mb=300.0 + growth)
    assert sim.states()["g1"] == ("stopping" if recycled else "idle")


# --------------------------------------------------------------------------- adaptive


def history(tmp_path: Path, test_id: str, durations: list[float]) -> Path:
    path = tmp_path / "timings.jsonl"
    lines = [
        {
            "finished_at": 1.0,
            "target": "m:f",
            "test_id": test_id,
            "spec": "ws1/gloo",
            "world_size": 1,
            "outcome": "passed",
            "duration_s": d,
            "queue_s": 0.0,
            "attempts": 1,
            "retries": 0,
            "group_id": "g1",
            "deadline_s": 90.0,
        }
        for d in durations
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("slowest", "deadline", "note"),
    [(20.0, 60.0, "learned: 3 \u00d7 slowest 20s"), (2.0, 30.0, "learned: floor 30s")],
)
def test_adaptive_deadline_is_learned_from_history(
    tmp_path: Path, slowest: float, deadline: float, note: str
) -> None:
    path = history(tmp_path, "t::a", [slowest / 2, slowest])
    sim = Sim(timings_file=path, adaptive_timeout=True, adaptive_k=3.0, adaptive_floor_s=30.0)
    sim.client()
    task = sim.submit(pool_spec=spec(1), test_id="t::a", timeout=500)
    sim.bring_up("g1")
    running = sim.broker.pools.groups["g1"].task
    assert running is not None
    assert running.timeout_s == deadline and running.deadline_note.startswith(note)
    sim.tick(deadline + 0.1)
    sim.stacks("g1", 0, task, "here")
    sim.tick(0.05)
    sim.bring_up("g2")
    retried = sim.broker.pools.groups["g2"].task
    assert retried is not None and retried.timeout_s == 500  # the retry gets what was asked
    assert note in sim.broker.tasks.tasks[retried.key].notes[0]


def test_a_test_without_history_gets_the_requested_deadline(tmp_path: Path) -> None:
    path = history(tmp_path, "t::a", [5.0])
    sim = Sim(timings_file=path, adaptive_timeout=True)
    sim.client()
    sim.submit(pool_spec=spec(1), test_id="t::other", timeout=42)
    sim.bring_up("g1")
    task = sim.broker.pools.groups["g1"].task
    assert task is not None and task.timeout_s == 42 and task.deadline_note == ""


def test_finished_tasks_are_recorded_and_learned_from(tmp_path: Path) -> None:
    path = tmp_path / "timings.jsonl"
    sim = Sim(timings_file=path, adaptive_timeout=True)
    sim.client()
    task = sim.submit(pool_spec=spec(1), test_id="t::rec")
    sim.bring_up("g1")
    sim.clock.advance(4.0)
    sim.finish_all("g1", task)
    (line,) = path.read_text().splitlines()
    record = json.loads(line)
    assert record["test_id"] == "t::rec" and record["duration_s"] == 4.0
    assert sim.broker.tasks.verdicts.history.slowest == {"t::rec": 4.0}


# --------------------------------------------------------------------------- clients


def test_a_silent_client_is_dropped_with_its_queued_tasks() -> None:
    sim = Sim(heartbeat_s=1.0, liveness=3, max_ranks=1)
    sim.client(b"quiet")
    sim.submit(client=b"quiet", pool_spec=spec(1))
    sim.submit(client=b"quiet", pool_spec=spec(1))
    for _ in range(8):
        sim.clock.advance(0.5)
        sim.broker.tick(sim.clock.monotonic())
    assert b"quiet" not in sim.broker.clients
    assert sim.broker.tasks.tasks == {} and not sim.broker.tasks.queues


def test_idle_exit_after_idle_exit_s_without_clients_or_tasks() -> None:
    sim = Sim(idle_exit_s=10.0)
    sim.tick(9.0)
    assert not sim.broker.stopping
    sim.tick(1.5)
    assert sim.broker.stopping


def test_status_describes_groups_queues_clients_and_totals() -> None:
    sim = Sim(max_ranks=1)
    sim.client(b"c1", name="me")
    sim.submit(pool_spec=spec(1))
    sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    status = sim.broker.status()
    assert set(status) == {"broker", "pools", "queue", "clients", "totals", "gpus", "wants"}
    (pool,) = status["pools"]
    assert pool["state"] == "busy" and pool["task"]["attempt"] == 1
    assert status["queue"][0]["depth"] == 1
    assert status["clients"][0]["name"] == "me" and status["clients"][0]["in_flight"] == 2
    assert status["totals"]["submitted"] == 2
    assert status["broker"]["uptime_s"] == 0.0  # the fake clock has not moved
