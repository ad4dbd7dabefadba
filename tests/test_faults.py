"""The fault matrix: every fault injector of ``workers/faults.py`` against a real broker.

For each fault: the verdict docs/design.md's outcome table promises, how fast it comes, whether
the group was recycled (status ``groups_started`` and pool ids), that no process of a
killed group survives, and that the next task on the same spec passes.

Cost control (a ws=2 group start is ~5-10 s on a small node): one private broker for the
module, run with ``--heartbeat 0.5 --liveness 4`` so a silent rank is dead after 2 s
instead of 5 s, and one pool spec whose group each test leaves warm for the next. Infra
faults strike once (``once_marker``), so attempt 1 dies, the retry passes on a fresh group,
and that fresh group serves the next test: one group start per infra fault, none for the
faults that must not cost a group (flooded output, values that cannot travel).

Covered elsewhere, not repeated here: a SIGKILLed rank (retried, passes) and a one-rank
failure's verdict and traceback, the deadline on a rank sleeping in Python,
``mutate_global_state`` and ``leak_memory`` in status (tests/test_core.py); recycling after
memory growth and after N tasks (tests/test_status.py); the SIGKILLed broker's orphans
check on an idle group (test_core; here it is killed mid-task, with a client waiting).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import ROOT, start_broker, stop_broker, wait_for_status

from cpq import BrokerUnavailable, Client, protocol
from cpq.protocol import RETRY_NOTE, TaskResult
from cpq.specs import make_spec

WS = 2
HEARTBEAT, LIVENESS = 0.5, 4
SILENCE = HEARTBEAT * LIVENESS  # a rank or client silent this long is dead
MARGIN = 3.0  # scheduling slack on a loaded 2-core machine
KILL_GRACE = 3.0  # the broker's default SIGTERM -> SIGKILL grace
FAILURE_GRACE = 3.0  # the broker's default --failure-grace
STACK_WAIT = 2.0  # the broker's default wait for rank stacks after a deadline
NOOP = "workers.collectives:noop"
HOLD = "workers.collectives:hold_until"
#: The spec every fault here runs on (its own, so no other module's group is touched).
POOL = {"env": {"CPQ_TEST_POOL": "fault-matrix"}, "roots": [str(ROOT)]}


def explain(result: TaskResult) -> str:
    lines = [f"outcome={result.outcome} attempts={result.attempts} message={result.message!r}"]
    lines += [f"note: {note}" for note in result.notes]
    for rank in result.ranks:
        lines.append(f"rank {rank.rank}: {rank.outcome} {rank.error}")
    return "\n".join(lines)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs: list[psutil.Process], within: float) -> None:
    deadline = time.monotonic() + within
    alive = procs
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.05)
    for proc in alive:  # never leave orphans behind, even when failing
        proc.kill()
    assert not alive, f"still running {within:g}s after their group was killed: {alive}"


@pytest.fixture(scope="module")
def fault_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    state = tmp_path_factory.mktemp("faults") / "state"
    process, endpoint = start_broker(
        state, "--gpus", "none", "--max-ranks", "4",
        "--heartbeat", str(HEARTBEAT), "--liveness", str(LIVENESS),
        "--spares", "0",  # these tests count the groups a fault replaces (test_spares: spares)
    )  # fmt: skip
    try:
        yield endpoint, state
    finally:
        stop_broker(process)


@pytest.fixture(scope="module")
def fc(fault_broker: tuple[str, Path]) -> Iterator[Client]:
    with Client(fault_broker[0], name="test_faults") as client:
        client.warm([make_spec(WS, POOL["env"], POOL["roots"])])  # starts while tests set up
        yield client


def submit(client: Client, target: str, kwargs: dict[str, Any] | None = None, **options: Any):
    return client.submit_async(target, WS, kwargs, **POOL, **options)


class Group:
    """The fault pool's current warm group: its id and every process it is made of."""

    def __init__(self, client: Client) -> None:
        warm = submit(client, NOOP).result(timeout=120)
        assert warm.outcome == "passed", explain(warm)
        self.id = warm.group_id
        (pool,) = [p for p in client.status()["pools"] if p["id"] == self.id]
        assert len(pool["rank_pids"]) == WS
        self.procs = [psutil.Process(pid) for pid in [pool["pid"], *pool["rank_pids"]]]


def alive_groups(status: dict[str, Any]) -> set[str]:
    return {p["id"] for p in status["pools"] if p["state"] != "stopping"}


def time_to_retry(client: Client, future: Future[TaskResult], before: dict[str, Any]) -> float:
    """Seconds from now until the broker has decided attempt 1 was an infra failure."""
    start = time.monotonic()
    while client.status()["totals"]["retries"] == before["retries"]:
        assert not future.done(), explain(future.result())
        assert time.monotonic() - start < 120, "the fault was never detected"
        time.sleep(0.05)
    return time.monotonic() - start


# --------------------------------------------------------------------------- no group lost


def test_100mb_on_stdout_and_stderr_is_bounded_and_costs_no_group(fc: Client) -> None:
    group = Group(fc)
    start = time.monotonic()
    result = submit(fc, "workers.faults:flood_output", {"megabytes": 100, "stderr": True})
    result = result.result(timeout=120)
    elapsed = time.monotonic() - start
    assert result.outcome == "passed", explain(result)
    assert result.group_id == group.id and result.attempts == 1
    limit = protocol.MAX_CAPTURE_BYTES + 200
    for rank in result.ranks:
        assert rank.value > 100 * 2**20
        for stream in (rank.stdout, rank.stderr):
            assert len(stream.encode()) <= limit
            assert stream.startswith(f"flood from rank {rank.rank} ")
            assert "bytes of output truncated" in stream
            assert stream.endswith(f"flood_output done on rank {rank.rank}\n")
    assert elapsed < 60, f"400 MB of output took {elapsed:.0f}s"
    after = submit(fc, NOOP).result(timeout=30)
    assert after.outcome == "passed" and after.group_id == group.id
    assert [(r.stdout, r.stderr) for r in after.ranks] == [("", "")] * WS


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("int_keys", "int is not allowed for map key"),
        ("deep", "recursion limit exceeded"),
        ("huge", "exceeds the 67108864-byte limit"),
    ],
)
def test_return_value_that_cannot_travel_fails_at_once(fc: Client, kind: str, words: str) -> None:
    """(A plain ``object()`` is tests/test_core.py's.) Before the fix, ``int_keys`` packed
    fine on the rank, the broker dropped the report as malformed, and the task hung until
    its deadline, twice."""
    group = Group(fc)
    start = time.monotonic()
    result = submit(fc, "workers.faults:unserialisable_return", {"kind": kind}, timeout=30)
    result = result.result(timeout=60)
    assert time.monotonic() - start < 10
    assert result.outcome == "failed", explain(result)
    assert result.attempts == 1 and result.notes == []
    assert result.group_id == group.id
    for rank in result.ranks:
        assert rank.outcome == "failed"
        assert rank.error is not None and "EncodeError" in rank.error.type
        assert words in rank.error.message, rank.error.message
    after = submit(fc, NOOP).result(timeout=30)
    assert after.outcome == "passed" and after.group_id == group.id


def test_killed_client_loses_its_queued_tasks_and_no_one_else_does(
    fc: Client, fault_broker: tuple[str, Path], tmp_path: Path
) -> None:
    """A client SIGKILLed with a running and 5 queued tasks: within the liveness window the
    broker forgets it and its queue; its running task is interrupted (the group stays warm:
    the ranks stopped cleanly) and another client's queued task runs on that group as if
    nothing happened."""
    group = Group(fc)
    release = tmp_path / "release"
    doomed = subprocess.Popen(
        [sys.executable, "-c", _DOOMED_CLIENT, fault_broker[0], str(release), str(ROOT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        assert doomed.stdout is not None
        line = doomed.stdout.readline()
        assert line.strip() == "submitted", line + doomed.stdout.read()

        def queued(status: dict[str, Any]) -> int:
            return sum(q["depth"] for q in status["queue"])

        before = wait_for_status(
            fc,
            "busy group and 5 queued tasks",
            lambda s: queued(s) == 5 and any(p["task"] for p in s["pools"]),
            within=30,
        )["totals"]
        mine = submit(fc, "workers.collectives:echo", {"who": "survivor"})
        wait_for_status(fc, "my task queued", lambda s: queued(s) == 6, within=10)
        doomed.kill()
        killed_at = time.monotonic()
        wait_for_status(
            fc,
            "the dead client and its queue dropped",
            # mine may have run already: the doomed client's running task was interrupted
            lambda s: queued(s) <= 1 and "doomed" not in {c["name"] for c in s["clients"]},
            within=SILENCE + MARGIN,
        )
        dropped_after = time.monotonic() - killed_at
        assert dropped_after <= SILENCE + MARGIN
    finally:
        release.touch()
        doomed.kill()
        doomed.wait()
    result = mine.result(timeout=60)
    assert result.outcome == "passed", explain(result)
    assert result.value == {"who": "survivor"} and result.group_id == group.id
    totals = wait_for_status(fc, "an empty queue", lambda s: not s["queue"], within=10)["totals"]
    assert totals["passed"] - before["passed"] == 1  # mine
    assert totals["errors"] - before["errors"] == 1  # the interrupted hold, told to no one
    log = (fault_broker[1] / "logs" / "broker.log").read_text()
    assert totals["groups_recycled"] == before["groups_recycled"], log[-3000:]
    assert totals["groups_started"] == before["groups_started"]


_DOOMED_CLIENT = """
import sys, time
from cpq import Client
endpoint, release, root = sys.argv[1:]
pool = {"env": {"CPQ_TEST_POOL": "fault-matrix"}, "roots": [root]}
client = Client(endpoint, name="doomed")
client.submit_async("workers.collectives:hold_until", 2, {"path": release}, **pool)
for _ in range(5):
    client.submit_async("workers.collectives:noop", 2, **pool)
print("submitted", flush=True)
time.sleep(600)
"""


# --------------------------------------------------------------------------- infra faults


def rank_stack(note: str, rank: int) -> str:
    """Rank ``rank``'s Python stack as a deadline's note reports it."""
    section = note.split(f"--- rank {rank} ---\n", 1)[1]
    return section.split("--- rank ", 1)[0].split("(retried on a fresh group)", 1)[0]


# Per hanging rank: what its stack must show (+) and must not show (-).
HUNG_IN_COLLECTIVE = {
    0: ["+dist.all_reduce(torch.ones(1))"],
    1: ["+threading.Event().wait()  # hang_in_collective: this rank never joins"],
}
SPINNING = {
    0: ["+dist.barrier()"],
    1: ["+in spin_in_python\n", "-_wait_for_peers", "-barrier"],  # spinning, not waiting
}

INFRA_FAULTS = [
    # target, kwargs, deadline, what attempt 1's note says, stacks, detected within (s)
    pytest.param(
        "workers.faults:sigstop", {}, 60, "rank 1 stopped heartbeating", {},
        SILENCE + MARGIN, id="sigstop",
    ),
    # (a dead rank's torchrun may take longer to exit than the silence takes to be seen
    # on a loaded box: either is how the broker learns of it; an os._exit too, seen so
    # with the suite's two xdist workers on two cores)
    pytest.param(
        "workers.faults:segfault", {}, 60, "torchrun exited with status | stopped heartbeating",
        {}, SILENCE + MARGIN, id="segfault",
    ),
    pytest.param(
        "workers.faults:exit_code", {"code": 3}, 60,
        "torchrun exited with status | stopped heartbeating", {}, SILENCE + MARGIN,
        id="os-exit-3",
    ),
    pytest.param(
        "workers.faults:hang_in_collective", {}, 3, "deadline of 3s passed",
        HUNG_IN_COLLECTIVE, 3 + STACK_WAIT + MARGIN, id="hang-in-collective",
    ),
    pytest.param(
        "workers.faults:spin_in_python", {}, 3, "deadline of 3s passed", SPINNING,
        3 + STACK_WAIT + MARGIN, id="spin-in-python",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("target", "kwargs", "deadline", "reason", "stacks", "within"), INFRA_FAULTS
)
def test_infra_fault_is_retried_once_on_a_fresh_group_and_passes(
    fc: Client,
    tmp_path: Path,
    target: str,
    kwargs: dict[str, Any],
    deadline: float,
    reason: str,
    stacks: dict[int, list[str]],
    within: float,
) -> None:
    group = Group(fc)
    before = fc.status()["totals"]
    marker = tmp_path / "struck"
    future = submit(fc, target, {**kwargs, "once_marker": str(marker)}, timeout=deadline)
    detected = time_to_retry(fc, future, before)
    result = future.result(timeout=120)
    assert marker.exists()  # attempt 1 really misbehaved
    assert result.outcome == "passed", explain(result)
    assert result.attempts == 2
    assert len(result.notes) == 1 and result.notes[0].startswith(RETRY_NOTE), result.notes
    note = result.notes[0]
    if "deadline" not in reason:
        assert f"on group {group.id}:" in note, note  # attempt 1 died on the warm group
    assert any(words in note.splitlines()[0] for words in reason.split(" | ")), note
    for rank, expectations in stacks.items():
        stack = rank_stack(note, rank)
        for expected in expectations:
            assert (expected[1:] in stack) == (expected[0] == "+"), f"rank {rank}:\n{stack}"
    assert detected <= within, f"attempt 1's failure took {detected:.1f}s to detect"
    if "deadline" in reason:  # not early, and the busy rank's heartbeats kept flowing
        assert detected >= deadline - 0.25, f"the deadline fired after {detected:.1f}s"
    # The failed group is gone (every process of it), the retry ran on the one new group,
    # and that group serves the next task.
    assert result.group_id != group.id
    status = fc.status()
    assert group.id not in alive_groups(status)
    assert status["totals"]["groups_started"] == before["groups_started"] + 1
    assert status["totals"]["retries"] == before["retries"] + 1
    wait_gone(group.procs, within=KILL_GRACE + MARGIN)
    after = submit(fc, NOOP).result(timeout=30)
    assert after.outcome == "passed" and after.group_id == result.group_id


def test_rank_holding_the_gil_while_computing_is_busy_not_dead(fc: Client) -> None:
    """A rank computing with the GIL held (as in one long native call) cannot heartbeat:
    its I/O thread needs the GIL. Yet it is healthy: the broker sees its main thread's CPU
    time grow, and the task finishes on the same group, once, with no retry."""
    group = Group(fc)
    before = fc.status()["totals"]
    future = submit(fc, "workers.faults:hold_gil", {"seconds": SILENCE * 2.5}, timeout=60)
    result = future.result(timeout=120)
    assert result.outcome == "passed", explain(result)
    held = result.ranks[1].value["longest_gil_gap_s"]
    assert held > SILENCE + 2 * HEARTBEAT, f"the GIL was held for only {held:.1f}s"
    assert result.attempts == 1 and result.notes == [], result.notes
    assert result.group_id == group.id
    totals = fc.status()["totals"]
    assert totals["groups_started"] == before["groups_started"]
    assert totals["busy_silences"] == before["busy_silences"] + 1


def test_client_holding_the_gil_while_computing_keeps_its_tasks(
    fault_broker: tuple[str, Path], fc: Client
) -> None:
    """The same for a client: a pytest process importing a heavy extension cannot
    heartbeat, but it is computing, so the broker keeps it and its task's verdict arrives."""
    from workers.faults import hold_gil_for

    Group(fc)  # the pool is warm, so the task runs (and finishes) while this process is busy
    endpoint, _ = fault_broker
    with Client(endpoint, name="gil-holder") as client:
        before = client.status()["totals"]
        # Still running when this process's silence passes the limit: a dropped client's
        # running task would finish into the void.
        future = submit(client, "workers.collectives:sleep", {"seconds": SILENCE * 3.5})
        held = hold_gil_for(SILENCE * 2.5)  # this process: its clients' I/O threads stall
        assert held > SILENCE + 2 * HEARTBEAT, f"the GIL was held for only {held:.1f}s"
        result = future.result(timeout=60)
        assert result.outcome == "passed", explain(result)
        status = client.status()
    assert status["totals"]["busy_silences"] > before["busy_silences"]
    assert {"gil-holder", "test_faults"} <= {c["name"] for c in status["clients"]}


def test_failure_with_a_stuck_peer_recycles_the_group(fc: Client) -> None:
    """(The verdict's details are test_core's.) Here: within 10 s, the stuck group is
    killed, not reused, and the next task passes on a fresh one; no retry."""
    group = Group(fc)
    before = fc.status()["totals"]
    start = time.monotonic()
    result = submit(fc, "workers.faults:raise_while_peer_waits", {"rank": 1}, timeout=60)
    result = result.result(timeout=60)
    elapsed = time.monotonic() - start
    assert result.outcome == "failed", explain(result)
    assert elapsed <= FAILURE_GRACE + STACK_WAIT + MARGIN <= 10, f"took {elapsed:.1f}s"
    assert result.attempts == 1 and result.notes == []
    assert {r.rank: r.outcome for r in result.ranks} == {0: "error", 1: "failed"}
    assert group.id not in alive_groups(fc.status())
    wait_gone(group.procs, within=KILL_GRACE + MARGIN)
    after = submit(fc, NOOP).result(timeout=120)
    assert after.outcome == "passed", explain(after)
    assert after.group_id != group.id
    totals = fc.status()["totals"]
    assert totals["groups_started"] == before["groups_started"] + 1
    assert totals["retries"] == before["retries"]


def test_a_rank_report_the_broker_cannot_decode_ends_the_task_at_once(fc: Client) -> None:
    """Rank 1 sends its report with an outcome no cpq knows: the task is an ``error`` at
    once (not at its 60 s deadline), naming the rank and what the decoder refused, with
    rank 0's report kept; not retried; the group, in an unknown state, is recycled."""
    group = Group(fc)
    before = fc.status()["totals"]
    start = time.monotonic()
    result = submit(fc, "workers.faults:garble_report", {"rank": 1}, timeout=60)
    result = result.result(timeout=60)
    elapsed = time.monotonic() - start
    assert result.outcome == "error" and result.attempts == 1, explain(result)
    assert f"rank 1 of group {group.id} sent a report the broker cannot read" in result.message
    assert "'passed-with-warnings' is not one of" in result.message, explain(result)
    assert elapsed <= MARGIN, f"took {elapsed:.1f}s"
    assert [(r.rank, r.outcome) for r in result.ranks] in ([], [(0, "passed")])
    status = fc.status()
    assert group.id not in alive_groups(status)
    # (and rank 0's report, when it comes after its group was stopped: an unknown peer's)
    assert status["totals"]["malformed"] >= before["malformed"] + 1
    assert status["totals"]["retries"] == before["retries"]
    wait_gone(group.procs, within=KILL_GRACE + MARGIN)
    after = submit(fc, NOOP).result(timeout=120)
    assert after.outcome == "passed" and after.group_id != group.id, explain(after)


def test_rank_without_file_descriptors_is_recycled(
    fc: Client, fault_broker: tuple[str, Path]
) -> None:
    """A task that leaves its rank no free descriptors passes (it returned normally), but
    the group is recycled: otherwise every later test on it fails on its first ``open``."""
    group = Group(fc)
    before = fc.status()["totals"]
    result = submit(fc, "workers.faults:exhaust_fds", {"limit": 1024}).result(timeout=60)
    assert result.outcome == "passed", explain(result)
    assert all(r.value > 900 for r in result.ranks), explain(result)
    status = fc.status()
    assert group.id not in alive_groups(status)
    assert status["totals"]["groups_recycled"] == before["groups_recycled"] + 1
    wait_gone(group.procs, within=KILL_GRACE + MARGIN)
    after = submit(fc, "workers.faults:open_files", {"count": 64}).result(timeout=120)
    assert after.outcome == "passed", explain(after)
    assert after.group_id != group.id
    log = (fault_broker[1] / "logs" / "broker.log").read_text()
    assert f"stopping group {group.id}" in log and "file descriptors open of its limit" in log


# --------------------------------------------------------------------------- the broker


def test_broker_sigkilled_mid_task_then_restarted_on_the_same_endpoint(tmp_path: Path) -> None:
    """Default liveness (1 s x 5). The client waiting on a task hears of the broker's death
    within 5 s, even though a new broker is back on the same endpoint before that (its old
    connection reaches the new broker, which does not know it and does not heartbeat it);
    no rank of the old group survives; the stale sockets are cleaned up; new clients work."""
    state = tmp_path / "state"
    # No spare: a spare starting beside the held group would be a second pool (and orphans)
    process, endpoint = start_broker(state, "--gpus", "none", "--max-ranks", "2", "--spares", "0")
    release = tmp_path / "release"
    procs: list[psutil.Process] = []
    restarted = None
    try:
        client = Client(endpoint, name="survivor")
        held = client.submit_async(HOLD, WS, {"path": str(release)}, **POOL)
        status = wait_for_status(
            client, "the task running", lambda s: any(p["task"] for p in s["pools"]), 120
        )
        (pool,) = status["pools"]
        procs = [psutil.Process(pid) for pid in [pool["pid"], *pool["rank_pids"]]]
        silence = status["broker"]["heartbeat_s"] * status["broker"]["liveness"]
        backend = state / f"backend-{process.pid}.sock"
        assert backend.exists()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        killed_at = time.monotonic()
        assert Path(endpoint[len("ipc://") :]).exists()  # SIGKILL leaves the socket behind
        restarted, again = start_broker(
            state, "--gpus", "none", "--max-ranks", "2", "--spares", "0"
        )
        assert again == endpoint
        with pytest.raises(BrokerUnavailable, match="stopped answering"):
            held.result(timeout=silence + MARGIN + 5)
        told_after = time.monotonic() - killed_at
        assert told_after <= silence + MARGIN, f"the client was told after {told_after:.1f}s"
        with pytest.raises(BrokerUnavailable):
            client.submit_async(NOOP, WS, **POOL)  # and says so on every later call
        client.close()
        wait_gone(procs, within=15)
        assert not backend.exists(), "the dead broker's backend socket was not cleaned up"
        with Client(endpoint, name="after-restart") as fresh:
            assert fresh.status()["broker"]["pid"] == restarted.pid
            result = fresh.submit(NOOP, 1, **POOL)
            assert result.outcome == "passed", explain(result)
    finally:
        release.touch()
        for proc in procs:
            if _running(proc):
                proc.kill()
        if process.poll() is None:
            stop_broker(process)
        if restarted is not None:
            stop_broker(restarted)


def test_client_keeps_up_with_a_brokers_short_heartbeat(tmp_path: Path) -> None:
    """A broker run with ``--heartbeat 0.2 --liveness 3`` drops a client silent for 0.6 s;
    a client keeping its own 1 s default would be dropped between two heartbeats (and its
    queued tasks with it). Clients adopt the broker's pace, and notice its death as fast."""
    process, endpoint = start_broker(
        tmp_path / "state", "--gpus", "none", "--heartbeat", "0.2", "--liveness", "3"
    )
    try:
        with Client(endpoint, name="steady") as client:  # heartbeat_s=1.0 by default
            assert (client.heartbeat_s, client.liveness) == (0.2, 3)
            time.sleep(3)
            # Still the client that said hello (one dropped and heard again is a stranger).
            (seen,) = client.status()["clients"]
            assert seen["name"] == "steady" and seen["last_seen_s"] < 0.6, seen
            process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(BrokerUnavailable, match="stopped answering"):
                client.status(timeout_s=30)
            assert time.monotonic() - killed_at <= 0.6 + MARGIN
    finally:
        if process.poll() is None:
            stop_broker(process)


@pytest.fixture
def full_log_dir(tmp_path: Path) -> Iterator[Path]:
    """A log directory on a full disk: a 64 kB tmpfs filled up (as root), else files that
    are links to /dev/full (every write fails with ENOSPC the same way)."""
    path = tmp_path / "logs"
    path.mkdir()
    mounted = os.geteuid() == 0 and (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(path)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        if mounted:
            filler = path / "filler"
            with open(filler, "wb", buffering=0) as out, contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * 4096)  # until ENOSPC
        else:
            for name in ("broker.log", "group-g1-agent.log", "group-g1-rank0.log"):
                (path / name).symlink_to("/dev/full")
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_log_disk_is_reported_once_and_the_broker_keeps_serving(
    tmp_path: Path, full_log_dir: Path
) -> None:
    state = tmp_path / "state"
    process, endpoint = start_broker(
        state, "--gpus", "none", "--max-ranks", "1", "--log-dir", str(full_log_dir)
    )
    try:
        with Client(endpoint, name="full-disk") as client:
            for n in range(3):
                result = client.submit("workers.collectives:echo", 1, {"n": n}, **POOL)
                assert result.outcome == "passed", explain(result)
                assert result.value == {"n": n}
            assert client.status()["totals"]["passed"] == 3
    finally:
        stop_broker(process)
    output = (state / "broker.stdout").read_text()
    warning = f"cannot write the log file {full_log_dir / 'broker.log'}"
    assert output.count(warning) == 1, output
    assert "No space left on device" in output
    assert "--- Logging error ---" not in output
    assert re.search(r"group g1-[0-9a-z]+ \(ws1/auto", output), output  # to stderr still
    assert "ready in" in output
