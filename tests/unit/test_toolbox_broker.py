"""The broker's side of the pytest toolbox: the infra-retry count a task asks for, and the
post-mortem relay that holds a failed task's group for ``pytest --pdb``."""

from __future__ import annotations

import pytest

from cpq import protocol
from cpq.protocol import RETRY_FAIL_NOTE, RETRY_NOTE

from .fakes import Sim, spec


def fail_group(sim: Sim, group: str) -> None:
    sim.tick(0.05)
    sim.bring_up(group)
    sim.processes[group].code = -9  # torchrun exited: a rank died
    sim.tick(0.05)


@pytest.mark.parametrize("retries", [0, 1, 2])
def test_a_task_gets_as_many_attempts_as_it_asked_retries_for(retries: int) -> None:
    sim = Sim()
    sim.client()
    sim.submit(pool_spec=spec(1), retries=retries)
    for n in range(retries + 1):
        assert sim.done() == {}, f"a verdict after {n} of {retries + 1} attempts"
        fail_group(sim, f"g{n + 1}")
    (result,) = sim.done().values()
    assert result.outcome == "error" and result.attempts == retries + 1
    assert [n.split()[0] for n in result.notes] == [RETRY_NOTE] * retries + (
        [RETRY_FAIL_NOTE] if retries else []
    )
    assert sim.broker.totals.groups_failed == retries + 1
    assert "torchrun exited with status -9" in result.message


def test_a_retry_count_out_of_range_is_refused() -> None:
    sim = Sim()
    sim.client()
    sim.submit(pool_spec=spec(1), retries=-1)
    (result,) = sim.done().values()
    assert result.outcome == "error" and "retries must be between 0 and" in result.message


def open_session(sim: Sim, debug_rank: int, failing: tuple[int, ...]) -> tuple[str, str]:
    sim.client(features=sorted(protocol.ALL_FEATURES))  # a client that reads debug_rank
    task = sim.submit(pool_spec=spec(3), debug_rank=debug_rank)
    sim.bring_up("g1")
    runs = sim.sent_to_ranks(protocol.RunTask)
    assert runs and all(m.debug for _, m in runs)
    for rank in range(3):
        sim.report("g1", rank, task, "failed" if rank in failing else "passed")
    return task, sim.states()["g1"]


def test_a_failed_task_under_pdb_holds_its_group_for_the_named_failing_rank() -> None:
    sim = Sim()
    task, state = open_session(sim, debug_rank=2, failing=(1, 2))
    (result,) = sim.done().values()
    assert result.outcome == "failed" and result.debug_rank == 2
    assert state == "busy"  # held: nobody else's task runs on it meanwhile
    released = sim.sent_to_ranks(protocol.DebugAttach)
    assert [(who, m.start) for who, m in released] == [(sim.rank_id("g1", 1), False)]
    sim.client_send(b"c1", protocol.DebugAttach(task, start=True))
    sim.client_send(b"c1", protocol.DebugLine(task, line="p some_local"))
    assert sim.sent_to_ranks(protocol.DebugLine)[0][0] == sim.rank_id("g1", 2)
    sim.rank_send(sim.rank_id("g1", 2), protocol.DebugOutput(task, text="41\n", prompt=True))
    sim.rank_send(sim.rank_id("g1", 2), protocol.DebugOutput(task, ended=True))
    texts = [m.text for who, m in sim.wire.to_clients if isinstance(m, protocol.DebugOutput)]
    assert texts == ["41\n", ""]
    assert sim.states()["g1"] == "stopping"  # recycled: its state after a debugger is unknown
    assert "a debugger ran on rank 2" in sim.broker.pools.groups["g1"].stop_reason


def test_the_lowest_failing_rank_is_debugged_when_the_named_one_passed() -> None:
    sim = Sim()
    open_session(sim, debug_rank=0, failing=(1, 2))
    (result,) = sim.done().values()
    assert result.debug_rank == 1


def test_a_session_nobody_opens_or_whose_client_leaves_recycles_the_group() -> None:
    sim = Sim()
    task, _ = open_session(sim, debug_rank=-1, failing=(0,))
    sim.client_send(b"c1", protocol.DebugAttach(task, start=False))
    assert sim.states()["g1"] == "stopping"
    sim = Sim()
    open_session(sim, debug_rank=-1, failing=(0,))
    sim.client_send(b"c1", protocol.Goodbye())
    assert sim.states()["g1"] == "stopping"


def test_a_passing_task_under_pdb_frees_its_group_as_usual() -> None:
    sim = Sim()
    open_session(sim, debug_rank=-1, failing=())
    (result,) = sim.done().values()
    assert result.outcome == "passed" and result.debug_rank == -1
    assert sim.states()["g1"] == "idle"
