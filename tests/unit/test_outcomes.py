"""The outcome table, retry-once, the grace after a peer failed, deadlines with stacks."""

from __future__ import annotations

import itertools

import pytest

from cpq import protocol
from cpq.broker.verdicts import verdict
from cpq.protocol import RETRY_FAIL_NOTE, RETRY_NOTE, RankResult

from .fakes import Sim, spec

# every outcome a rank may report, and one no version of cpq knows (a decoder bypassed or a
# future rank): the table must fail closed on it
OUTCOMES = ("passed", "failed", "skipped", "error", "weird")


def expected(outcomes: tuple[str, ...]) -> str:
    """The table of docs/design.md, written independently of cpq.broker.verdicts."""
    if "failed" in outcomes:
        return "failed"
    if any(o not in ("passed", "failed", "skipped") for o in outcomes):
        return "error"  # an error or an unknown outcome: never a pass
    if set(outcomes) == {"skipped"}:
        return "skipped"
    if "skipped" in outcomes:
        return "failed"  # a skip must be taken on every rank
    return "passed"


ALL_REPORTS = [o for ws in (1, 2, 3, 4) for o in itertools.product(OUTCOMES, repeat=ws)]


def reports(outcomes: tuple[str, ...]) -> list[RankResult]:
    return [
        RankResult(
            rank=r,
            outcome=o,  # type: ignore[arg-type]  # "weird" on purpose
            error=protocol.RankError("E", f"why {r}") if o != "passed" else None,
        )
        for r, o in enumerate(outcomes)
    ]


@pytest.mark.parametrize("outcomes", ALL_REPORTS, ids="-".join)
def test_verdict_follows_the_outcome_table(outcomes: tuple[str, ...]) -> None:
    outcome, message = verdict(reports(outcomes), len(outcomes))
    assert outcome == expected(outcomes)
    if outcome == "skipped":
        assert message == "why 0"
    if outcome == "failed" and "failed" not in outcomes:
        assert "skipped while the others ran" in message
    if outcome == "error":
        assert "weird" in message or "reported an error" in message


@pytest.mark.parametrize("outcomes", [o for o in ALL_REPORTS if "failed" not in o], ids="-".join)
def test_a_rank_missing_from_the_reports_is_never_a_pass(outcomes: tuple[str, ...]) -> None:
    # one rank short, or a rank reported twice: the task did not run everywhere
    short = reports(outcomes)[:-1]
    assert verdict(short, len(outcomes))[0] == "error"
    twice = [*reports(outcomes), reports(outcomes)[0]]
    assert verdict(twice, len(outcomes))[0] == "error"


KNOWN_REPORTS = [o for o in ALL_REPORTS if len(o) <= 3 and "weird" not in o]


@pytest.mark.parametrize("outcomes", KNOWN_REPORTS, ids="-".join)
def test_every_rank_reporting_gives_one_verdict_and_frees_the_group(
    outcomes: tuple[str, ...],
) -> None:
    sim = Sim()
    sim.client()
    task = sim.submit(pool_spec=spec(len(outcomes)))
    sim.bring_up("g1")
    assert sim.running("g1") == task
    for rank, outcome in enumerate(outcomes):
        sim.report("g1", rank, task, outcome)
    (result,) = sim.done().values()
    assert result.outcome == expected(outcomes)
    assert [r.rank for r in result.ranks] == list(range(len(outcomes)))
    assert result.attempts == 1 and result.notes == [] and result.group_id == "g1"
    assert sim.states() == {"g1": "idle"}  # a failing test does not cost its group
    totals = sim.broker.totals
    counter = "errors" if result.outcome == "error" else result.outcome
    assert getattr(totals, counter) == 1 and totals.retries == 0


def test_a_late_report_for_a_decided_task_is_ignored() -> None:
    sim = Sim()
    sim.client()
    task = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    sim.report("g1", 0, task)
    sim.report("g1", 0, task, "failed")
    assert [r.outcome for r in sim.done().values()] == ["passed"]
    assert sim.broker.totals.failed == 0


# --------------------------------------------------------------------------- grace


@pytest.mark.parametrize("answer", [True, False], ids=["stacks", "no-answer"])
def test_peer_failed_and_the_others_hang_failed_after_the_grace_with_their_stacks(
    answer: bool,
) -> None:
    sim = Sim(failure_grace_s=3.0, stack_wait_s=2.0)
    sim.client()
    task = sim.submit(pool_spec=spec(3))
    sim.bring_up("g1")
    pid = sim.broker.pools.groups["g1"].ranks[1].pid
    sim.report("g1", 0, task, "failed")
    sim.tick(2.9)
    assert sim.done() == {} and not sim.sent_to_ranks(protocol.DumpStacks)
    sim.tick(0.2)
    asked = sorted(who for who, _ in sim.sent_to_ranks(protocol.DumpStacks))
    assert asked == [sim.rank_id("g1", 1), sim.rank_id("g1", 2)]  # not the failed rank
    if answer:
        sim.stacks("g1", 1, task, "in all_reduce", stdout="rank 1 started\n", stderr="w\n")
        sim.stacks("g1", 2, task, "in barrier")
    else:
        sim.tick(2.1)
    (result,) = sim.done().values()
    assert result.outcome == "failed" and result.attempts == 1
    assert "rank(s) [0] failed; rank(s) [1, 2] were stuck" in result.message
    stuck = {r.rank: r for r in result.ranks if r.outcome == "error"}
    assert set(stuck) == {1, 2} and stuck[1].error is not None
    assert stuck[1].error.type == "cpq.RankStuck"
    if answer:
        assert stuck[1].error.traceback == "in all_reduce"
        # what it printed before it was stopped, as torchrun shows a stopped worker's
        assert (stuck[1].stdout, stuck[1].stderr) == ("rank 1 started\n", "w\n")
        assert (stuck[2].stdout, stuck[2].stderr) == ("", "")
    assert f"(pid: {pid})" in stuck[1].error.message  # torchrun's summary names it
    assert sim.processes["g1"].terminated_with is not None  # recycled: ranks may be stuck
    assert sim.states().get("g1", "stopping") == "stopping"
    assert sim.broker.totals.retries == 0


def test_the_others_finishing_within_the_grace_is_a_plain_failure() -> None:
    sim = Sim(failure_grace_s=3.0)
    sim.client()
    task = sim.submit(pool_spec=spec(2))
    sim.bring_up("g1")
    sim.report("g1", 0, task, "failed")
    sim.tick(2.0)
    sim.report("g1", 1, task, "passed")
    (result,) = sim.done().values()
    assert result.outcome == "failed" and sim.states() == {"g1": "idle"}


# --------------------------------------------------------------------------- retry once


def test_deadline_collects_every_ranks_stack_then_retries_once_on_a_fresh_group() -> None:
    sim = Sim(stack_wait_s=2.0)
    sim.client()
    task = sim.submit(pool_spec=spec(2), timeout=10)
    sim.bring_up("g1")
    sim.tick(9.9)
    assert not sim.sent_to_ranks(protocol.DumpStacks)
    sim.tick(0.2)
    assert len(sim.sent_to_ranks(protocol.DumpStacks)) == 2  # every rank: all may hang
    sim.stacks("g1", 0, task, "rank0 in recv")
    sim.stacks("g1", 1, task, "rank1 in send")
    assert sim.done() == {}  # retried, not answered
    assert sim.states()["g1"] == "stopping"
    assert sim.broker.totals.retries == 1
    sim.tick(0.05)  # the stopped group is reaped; a fresh one starts for the retry
    assert "g2" in sim.states()
    sim.bring_up("g2")
    assert sim.running("g2") == task
    sim.finish_all("g2", task)
    (result,) = sim.done().values()
    assert result.outcome == "passed" and result.attempts == 2
    (note,) = result.notes
    assert note.startswith(RETRY_NOTE) and "deadline of 10s passed" in note
    assert "rank0 in recv" in note and "rank1 in send" in note


def test_a_rank_that_begins_the_test_late_moves_the_deadline() -> None:
    """The deadline times the test, not the rank's pytest session build before it: a rank's
    ``rank_begun`` restarts it (pytest-timeout's timer starts at the test in a fresh run)."""
    sim = Sim(stack_wait_s=2.0)
    sim.client()
    task = sim.submit(pool_spec=spec(2), timeout=10)
    sim.bring_up("g1")
    sim.tick(8.0)  # building the session and collecting took 8 s
    for rank in (0, 1):
        sim.rank_send(Sim.rank_id("g1", rank), protocol.RankBegun(task_id=task, rank=rank))
    sim.tick(9.0)  # 17 s after dispatch, 9 s into the test: still in time
    assert not sim.sent_to_ranks(protocol.DumpStacks)
    sim.tick(1.1)
    assert len(sim.sent_to_ranks(protocol.DumpStacks)) == 2


def test_a_session_build_longer_than_the_timeout_is_not_a_hang() -> None:
    """A pytest item's deadline waits for the rank's session build (the start allowance):
    a 12 s build under a 10 s timeout is not ended; the test's own 10 s follow it."""
    sim = Sim(stack_wait_s=2.0)
    sim.client()
    task = sim.submit(pool_spec=spec(2), timeout=10, target=protocol.PYTEST_ITEM_TARGET)
    sim.bring_up("g1")
    sim.tick(12.0)  # plugins and conftests imported for 12 s
    assert not sim.sent_to_ranks(protocol.DumpStacks)
    sim.rank_send(Sim.rank_id("g1", 0), protocol.RankBegun(task_id=task, rank=0))
    sim.tick(9.9)
    assert not sim.sent_to_ranks(protocol.DumpStacks)
    sim.tick(0.2)  # 10 s after the first rank began: rank 1 never did, a hang
    assert len(sim.sent_to_ranks(protocol.DumpStacks)) == 2


def _two_ranks_5s_into_a_test() -> tuple[Sim, str]:
    """A pytest item (10 s timeout) both of whose ranks began its protocol 5 s ago."""
    sim = Sim(stack_wait_s=2.0)
    sim.client()
    task = sim.submit(pool_spec=spec(2), timeout=10, target=protocol.PYTEST_ITEM_TARGET)
    sim.bring_up("g1")
    for rank in (0, 1):
        sim.rank_send(Sim.rank_id("g1", rank), protocol.RankBegun(task_id=task, rank=rank))
    sim.tick(5.0)
    return sim, task


def test_the_sessions_finish_after_the_last_test_is_not_timed_while_a_rank_is_in_it() -> None:
    """A rank's second ``rank_begun`` (its protocol ended; pytest's session finish follows)
    extends the deadline only once every rank is past its test: a rank still in the test
    keeps the test's deadline."""
    sim, task = _two_ranks_5s_into_a_test()
    sim.rank_send(Sim.rank_id("g1", 0), protocol.RankBegun(task_id=task, rank=0))  # done
    sim.tick(5.1)  # rank 1 is still in the test 10 s on: a hang
    assert len(sim.sent_to_ranks(protocol.DumpStacks)) == 2


def test_the_sessions_finish_gets_the_start_allowance_once_every_rank_is_past_its_test() -> None:
    sim, task = _two_ranks_5s_into_a_test()
    for rank in (0, 1):  # both tests done: pytest's session finish (a gc pass per plugin)
        sim.rank_send(Sim.rank_id("g1", rank), protocol.RankBegun(task_id=task, rank=rank))
    sim.tick(30.0)
    assert not sim.sent_to_ranks(protocol.DumpStacks)
    sim.finish_all("g1", task)
    (result,) = sim.done().values()
    assert result.outcome == "passed"


def test_a_function_task_has_no_build_allowance() -> None:
    """A target other than a pytest item sends no ``rank_begun``: its deadline runs from
    dispatch."""
    sim = Sim(stack_wait_s=2.0)
    sim.client()
    sim.submit(pool_spec=spec(2), timeout=10)
    sim.bring_up("g1")
    sim.tick(10.1)
    assert len(sim.sent_to_ranks(protocol.DumpStacks)) == 2


def test_a_second_infra_failure_is_the_verdict() -> None:
    sim = Sim()
    sim.client()
    sim.submit(pool_spec=spec(1), timeout=5)
    for group in ("g1", "g2"):
        sim.tick(0.05)
        sim.bring_up(group)
        sim.processes[group].code = -9  # torchrun exited: a rank died
        sim.tick(0.05)
    (result,) = sim.done().values()
    assert result.outcome == "error" and result.attempts == 2
    assert result.notes[0].startswith(RETRY_NOTE)
    assert result.notes[1].startswith(RETRY_FAIL_NOTE)
    assert "torchrun exited with status -9" in result.message
    assert sim.broker.totals.retries == 1 and sim.broker.totals.groups_failed == 2


def test_a_silent_rank_fails_its_group_and_the_task_is_retried() -> None:
    sim = Sim(heartbeat_s=1.0, liveness=5)
    sim.client()
    task = sim.submit(pool_spec=spec(2))
    sim.bring_up("g1")
    sim.processes["g1"].gone_after_terminate = False
    for _ in range(12):  # rank 1 goes quiet; rank 0 and the client keep heartbeating
        sim.clock.advance(0.5)
        sim.rank_send(sim.rank_id("g1", 0), protocol.Heartbeat())
        sim.client_send(b"c1", protocol.Heartbeat())
        sim.broker.tick(sim.clock.monotonic())
    assert sim.states()["g1"] == "stopping"
    assert "rank 1 stopped heartbeating" in sim.broker.pools.groups["g1"].stop_reason
    sim.processes["g1"].gone_after_terminate = True
    sim.tick(0.05)
    sim.bring_up("g2")
    assert sim.running("g2") == task


def test_a_group_that_cannot_start_retries_its_queued_tasks_once_then_errors() -> None:
    sim = Sim(start_timeout_s=30)
    sim.client()
    a = sim.submit(pool_spec=spec(2))
    b = sim.submit(pool_spec=spec(2))
    sim.tick(31)  # g1 never came up
    assert sim.done() == {} and sim.broker.totals.retries == 2
    sim.tick(31)  # nor did g2
    results = sim.done()
    assert set(results) == {a, b}
    for result in results.values():
        assert result.outcome == "error" and result.attempts == 2
        assert "could not start: not ready after 30s" in result.message
        assert "--- end of the group's log ---" in result.message
        assert result.notes[0].startswith(RETRY_NOTE)


def test_torchrun_that_does_not_start_is_an_infra_error_retried_once() -> None:
    sim = Sim()
    sim.client()
    sim.fail_next_start = True
    task = sim.submit(pool_spec=spec(1))
    assert sim.broker.totals.retries == 1  # the retry started g2 at once
    sim.bring_up("g2")
    sim.finish_all("g2", task)
    assert sim.done()[task].outcome == "passed" and sim.done()[task].attempts == 2


def test_an_unreachable_rank_at_dispatch_fails_the_group_and_retries() -> None:
    sim = Sim()
    sim.client()
    sim.tick(0)
    sim.client_send(b"c1", protocol.Warm(specs=[spec(1)], counts=[1]))
    sim.bring_up("g1")
    sim.wire.unreachable_ranks.add(sim.rank_id("g1", 0))
    task = sim.submit(pool_spec=spec(1))
    assert sim.states()["g1"] == "stopping" and sim.broker.totals.retries == 1
    sim.tick(0.05)
    sim.bring_up("g2")
    sim.finish_all("g2", task)
    assert sim.done()[task].attempts == 2


def test_an_orphaned_task_is_not_retried_and_its_verdict_goes_nowhere() -> None:
    sim = Sim()
    sim.client()
    task = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    sim.client_send(b"c1", protocol.Goodbye())
    sim.processes["g1"].code = 1
    sim.tick(0.05)
    assert sim.done() == {} and sim.broker.totals.retries == 0
    assert sim.broker.tasks.tasks == {} and sim.broker.totals.errors == 1
    assert task  # the task was counted as an error, not retried


# --------------------------------------------------------------------------- admission


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"target": "no_colon"}, "must look like"),
        ({"target": "mod:"}, "must look like"),
        ({"timeout": -1.0}, "positive, finite"),
        ({"timeout": float("inf")}, "positive, finite"),
        ({"timeout": float("nan")}, "positive, finite"),
        ({"spec": spec(99)}, ""),
        ({"spec": protocol.PoolSpec(world_size=1, python="python3", roots=[])}, "interpreter"),
        (
            {"spec": protocol.PoolSpec(world_size=1, python="/nonexistent/py", roots=[])},
            "interpreter",
        ),
    ],
)
def test_a_task_that_can_never_run_is_rejected_at_once(change: dict, why: str) -> None:
    sim = Sim(max_ranks=8)
    sim.client()
    fields = {"task_id": "t", "target": "m:f", "spec": spec(1), **change}
    sim.client_send(b"c1", protocol.Submit(**fields))
    (result,) = sim.done().values()
    assert result.outcome == "error" and result.message.startswith("rejected: ")
    assert why in result.message
    assert sim.broker.totals.rejected == 1 and sim.broker.pools.groups == {}


def test_a_duplicate_task_id_is_rejected_and_the_first_runs_on() -> None:
    sim = Sim()
    sim.client()
    sim.submit(task_id="same", pool_spec=spec(1))
    sim.submit(task_id="same", pool_spec=spec(1))
    (result,) = sim.done().values()
    assert "already in flight" in result.message
    sim.bring_up("g1")
    assert sim.running("g1") == "same"


def test_cancel_drops_a_queued_task_and_orphans_a_running_one() -> None:
    sim = Sim(max_ranks=1)
    sim.client()
    running = sim.submit(pool_spec=spec(1))
    queued = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    sim.client_send(b"c1", protocol.Cancel(task_id=queued))
    assert sim.done()[queued].message == "cancelled by the client"
    sim.client_send(b"c1", protocol.Cancel(task_id=running))
    sim.finish_all("g1", running)
    assert running not in sim.done()
    assert sim.states() == {"g1": "idle"}


def test_draining_refuses_new_tasks_finishes_running_ones_then_stops() -> None:
    sim = Sim()
    sim.client()
    task = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    sim.client_send(b"c1", protocol.StopRequest(drain=True))
    late = sim.submit(pool_spec=spec(1))
    assert "draining" in sim.done()[late].message
    sim.tick(0.1)
    assert not sim.broker.stopping
    sim.finish_all("g1", task)
    sim.tick(0.1)
    assert sim.done()[task].outcome == "passed" and sim.broker.stopping


def test_stop_now_answers_every_task_in_flight() -> None:
    sim = Sim(max_ranks=1)
    sim.client()
    tasks = [sim.submit(pool_spec=spec(1)) for _ in range(3)]
    sim.client_send(b"c2", protocol.StopRequest())
    results = sim.done()
    assert set(results) == set(tasks)
    assert all("the broker stopped" in r.message for r in results.values())
    assert sim.broker.stopping
