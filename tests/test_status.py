"""``cpq-status`` and the timing history, against real brokers in known states.

What a user or a monitoring system reads: the status table, ``--json`` (a stable schema),
``--prometheus``, ``--watch``; the timing history and ``--timings``; learned deadlines; group
recycling; ``cpq drain``. States are reached by driving a real broker and polling its status,
never by sleeping: a busy group runs ``workers.collectives:hold_until``, which returns when
the test creates a file.

Group starts dominate the runtime (~8 s each on a small node), so the private brokers run
world-size-1 groups and each covers several behaviours in one life.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import ROOT, start_broker, stop_broker, wait_for_status
from prometheus_client.parser import text_string_to_metric_families

from cpq import Client, timings
from cpq.broker.history import TimingsLog
from cpq.client import interpreter
from cpq.client.autostart import broker_alive
from cpq.protocol import RETRY_NOTE, TaskResult

NOOP = "workers.collectives:noop"
HOLD = "workers.collectives:hold_until"
#: What the private brokers' tasks run on: a CPU group of one rank whose spec matches the
#: brokers' ``--warm ws1:gloo`` groups (same interpreter, same roots).
PRIVATE = {"world_size": 1, "backend": "gloo", "roots": [str(ROOT)]}

# The --json schema: these key sets are the contract (docs/design.md names the top level); a
# change here is a change for every consumer of the JSON, so it must be deliberate.
BROKER_KEYS = {
    "endpoint", "pid", "host", "version", "code", "protocol", "features", "started_at",
    "uptime_s", "gpus",
    "gpus_free", "max_ranks", "heartbeat_s", "liveness", "log_dir", "draining", "idle_exit_s",
    "default_timeout_s", "max_tasks_per_group", "max_rss_growth_mb", "timings_file",
    "adaptive_timeout", "adaptive_k", "adaptive_floor_s", "history_tests", "gpus_fake",
    "gpu_leases", "gpu_yields", "memory_mb", "memory_used_mb",
}  # fmt: skip
POOL_KEYS = {
    "id", "spec", "world_size", "backend", "env", "gpus", "state", "pid", "rank_pids",
    "uptime_s", "ready_after_s", "tasks_done", "rss_mb", "last_heartbeat_s", "task",
    "stop_reason", "python", "roots", "cuda_mb", "cuda_reserved_mb", "rss_growth_mb", "spare",
    "bound_env", "start_bound_env",
    "spec_id",
}  # fmt: skip
TASK_KEYS = {"target", "test_id", "session", "elapsed_s", "deadline_s", "deadline_note", "attempt"}
QUEUE_KEYS = {"spec", "spec_id", "world_size", "depth", "oldest_wait_s"}
CLIENT_KEYS = {
    "id", "host", "pid", "name", "xdist_worker", "in_flight", "submitted", "last_seen_s",
}  # fmt: skip
TOTALS_KEYS = {
    "submitted", "passed", "failed", "skipped", "errors", "retries", "rejected",
    "groups_started", "groups_failed", "group_start_s", "malformed", "groups_recycled",
    "timings_write_errors", "busy_silences",
}  # fmt: skip


def explain(result: TaskResult) -> str:
    ranks = "; ".join(f"rank {r.rank}: {r.outcome} {r.error}" for r in result.ranks)
    return f"{result.outcome} attempts={result.attempts} {result.message!r} {result.notes} {ranks}"


def cli(endpoint: str, state: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    """``cpq ARGS`` as a user runs it (this interpreter, so specs match)."""
    env = dict(os.environ, CPQ_ENDPOINT=endpoint)
    if state is not None:
        env["CPQ_STATE_DIR"] = str(state)
    return subprocess.run(
        [sys.executable, "-m", "cpq", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def broker_log(state: Path) -> str:
    return (state / "logs" / "broker.log").read_text()


Broker = tuple[str, Path, "subprocess.Popen[bytes]"]


@pytest.fixture
def private_broker(tmp_path: Path) -> Iterator[Callable[..., Broker]]:
    """Start private brokers with special flags; each is stopped (if still running) after."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> Broker:
        state = tmp_path / f"state{len(started)}"
        # no spares: these tests count the groups the broker starts (test_spares: spares)
        process, endpoint = start_broker(state, "--gpus", "none", "--spares", "0", *args)
        started.append(process)
        return endpoint, state, process

    yield start
    for process in started:
        if process.poll() is None:
            stop_broker(process)


# --------------------------------------------------------------------------- a broker's life


def test_status_through_a_brokers_life(
    private_broker: Callable[..., Broker], tmp_path: Path
) -> None:
    """Warm start → idle → busy with a queue → a rank killed and its group respawned →
    drain (running and queued tasks finish, new ones are refused) → the broker exits."""
    endpoint, state, process = private_broker(
        "--max-ranks", "1", "--scale-up-after", "600",
        "--warm", "ws1:gloo=1", "--warm-root", str(ROOT),
    )  # fmt: skip
    release = tmp_path / "release"
    with Client(endpoint, name="test_status") as client:
        # -- idle: the --warm group came up without any client asking for it
        status = wait_for_status(client, "idle warm group", lambda s: _states(s) == ["idle"])
        (pool,) = status["pools"]
        assert pool["spec"] == "ws1/gloo" and pool["roots"] == [str(ROOT)]
        assert pool["python"] == interpreter()  # the broker's own, as clients name it
        assert pool["tasks_done"] == 0 and pool["task"] is None
        assert pool["rss_mb"][0] > 50  # reported when ready (torch is imported)
        assert len(pool["rank_pids"]) == 1 and isinstance(pool["pid"], int)
        assert status["queue"] == []
        assert status["totals"]["groups_started"] == 1
        assert status["broker"]["timings_file"] == str(state / "timings.jsonl")

        # -- busy, with a task queued behind it
        held = client.submit_async(
            HOLD, kwargs={"path": str(release)}, timeout=60, test_id="life::held", **PRIVATE
        )
        wait_for_status(client, "busy group", lambda s: _states(s) == ["busy"])
        queued = client.submit_async(NOOP, test_id="life::queued", **PRIVATE)
        status = wait_for_status(client, "a queued task", lambda s: bool(s["queue"]))
        (pool,) = status["pools"]
        task = pool["task"]
        assert task["test_id"] == "life::held" and task["target"] == HOLD
        assert task["deadline_s"] == 60 and task["deadline_note"] == "" and task["attempt"] == 1
        assert 0 <= task["elapsed_s"] < 60
        (entry,) = status["queue"]
        assert entry["spec"] == "ws1/gloo" and entry["depth"] == 1 and entry["oldest_wait_s"] >= 0
        (me,) = [c for c in status["clients"] if c["name"] == "test_status"]
        assert me["host"] == socket.gethostname() and me["pid"] == os.getpid()
        assert me["xdist_worker"] == os.environ.get("PYTEST_XDIST_WORKER", "")
        assert me["in_flight"] == 2 and me["submitted"] == 2

        _check_json_schema(cli(endpoint, state, "status", "--json"))
        _check_prometheus(cli(endpoint, state, "status", "--prometheus"), pool["id"])
        screen = cli(endpoint, state, "status")
        assert screen.returncode == 0, screen.stderr
        for text in ("busy", "life::held (", "queued spec", "ws1/gloo", "test_status"):
            assert text in screen.stdout, screen.stdout

        # -- a rank dies mid-task: the group is replaced and the task retried on the new one
        old = pool["id"]
        psutil.Process(pool["rank_pids"][0]).kill()
        status = wait_for_status(
            client,
            "the task retried on a fresh group",
            lambda s: any(p["id"] != old and p["task"] for p in s["pools"]),
        )
        (new,) = [p for p in status["pools"] if p["id"] != old]
        assert new["task"]["test_id"] == "life::held" and new["task"]["attempt"] == 2
        assert all(p["state"] == "stopping" for p in status["pools"] if p["id"] == old)
        totals = status["totals"]
        assert (totals["groups_started"], totals["groups_failed"], totals["retries"]) == (2, 1, 1)

        # -- drain: what was accepted finishes, nothing new is accepted, then the broker stops
        drain = cli(endpoint, state, "drain")
        assert drain.returncode == 0, drain.stderr
        assert "1 running and 1 queued task(s) will finish" in drain.stdout
        assert client.status()["broker"]["draining"] is True
        refused = client.submit(NOOP, **PRIVATE)
        assert refused.outcome == "error" and "draining" in refused.message
        release.touch()
        result = held.result(timeout=60)
        assert result.outcome == "passed" and result.attempts == 2, explain(result)
        assert result.group_id == new["id"]
        assert result.notes[0].startswith(RETRY_NOTE), result.notes
        assert queued.result(timeout=60).outcome == "passed"
    assert process.wait(timeout=30) == 0
    assert "broker stopped" in broker_log(state)
    _, alive = psutil.wait_procs(_procs([new["pid"], *new["rank_pids"]]), timeout=15)
    assert not alive, f"still running after the broker exited: {alive}"


def _states(status: dict[str, Any]) -> list[str]:
    return [p["state"] for p in status["pools"]]


def _procs(pids: list[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    return procs


def _check_json_schema(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert set(status) == {"broker", "pools", "queue", "clients", "totals", "gpus", "wants"}
    assert set(status["broker"]) == BROKER_KEYS
    assert status["pools"] and status["queue"]
    for pool in status["pools"]:
        assert set(pool) == POOL_KEYS
        assert pool["task"] is None or set(pool["task"]) == TASK_KEYS
    assert any(pool["task"] for pool in status["pools"])
    assert all(set(q) == QUEUE_KEYS for q in status["queue"])
    assert all(set(c) == CLIENT_KEYS for c in status["clients"])
    assert set(status["totals"]) == TOTALS_KEYS


def _check_prometheus(proc: subprocess.CompletedProcess[str], group: str) -> None:
    assert proc.returncode == 0, proc.stderr
    families = {f.name: f for f in text_string_to_metric_families(proc.stdout)}

    def value(family: str, **labels: str) -> float:
        matches = [s.value for s in families[family].samples if s.labels == labels]
        assert len(matches) == 1, (family, labels, families[family].samples)
        return matches[0]

    assert value("cpq_up") == 1
    assert families["cpq_tasks"].type == "counter"
    assert {s.labels["outcome"] for s in families["cpq_tasks"].samples} == {
        "passed",
        "failed",
        "skipped",
        "error",
    }
    assert value("cpq_groups_started") == 1
    assert value("cpq_retries") == 0
    assert value("cpq_groups", state="busy") == 1
    assert value("cpq_groups", state="idle") == 0
    assert value("cpq_queue_depth", spec="ws1/gloo") == 1
    assert value("cpq_group_rss_bytes", group=group, rank="0") > 50 * 2**20
    assert value("cpq_tasks_in_flight") == 2
    assert families["cpq_group_rss_bytes"].type == "gauge"


# --------------------------------------------------------------------------- recycling


def test_groups_are_recycled_after_max_tasks_and_after_memory_growth(
    private_broker: Callable[..., Broker],
) -> None:
    """Also: a timing history that cannot be written (a full disk) never breaks the broker."""
    endpoint, state, _ = private_broker(
        "--max-ranks", "2", "--max-tasks-per-group", "2", "--max-rss-growth", "64",
        "--timings-file", "/dev/full",
    )  # fmt: skip
    counted = {"env": {"CPQ_TEST_POOL": "counted"}, **PRIVATE}
    leaky = {"env": {"CPQ_TEST_POOL": "leaky"}, **PRIVATE}
    with Client(endpoint, name="test_status") as client:
        client.warm([_spec(counted), _spec(leaky)])  # both groups start at once
        first = client.submit(NOOP, **counted)
        second = client.submit(NOOP, **counted)
        leak = client.submit("workers.faults:leak_memory", kwargs={"megabytes": 100}, **leaky)
        for result in (first, second, leak):
            assert result.outcome == "passed", explain(result)
        assert first.group_id == second.group_id != leak.group_id
        status = client.status()
        alive = {p["id"]: p for p in status["pools"] if p["state"] != "stopping"}
        assert first.group_id not in alive and leak.group_id not in alive, status["pools"]
        assert status["totals"]["groups_recycled"] == 2
        assert status["totals"]["timings_write_errors"] == 3
    log = broker_log(state)
    assert f"stopping group {first.group_id} (ws1/gloo" in log
    assert "recycled after 2 tasks" in log
    assert "recycled: rank 0 RSS grew 1" in log  # ~100 MB
    assert log.count("cannot write the timing history /dev/full") == 1


def _spec(options: dict[str, Any]) -> Any:
    from cpq.specs import make_spec

    return make_spec(options["world_size"], options["env"], options["roots"], options["backend"])


# --------------------------------------------------------------------------- learned deadlines


def test_adaptive_deadline_is_learned_from_history(
    private_broker: Callable[..., Broker], tmp_path: Path
) -> None:
    history = tmp_path / "timings.jsonl"
    with history.open("w") as out:
        for test_id, duration in [("slow", 0.4), ("slow", 0.5), ("quick", 0.01)]:
            out.write(json.dumps(_timing(f"adaptive::{test_id}", duration)) + "\n")
        out.write('{"torn line\n')
    endpoint, _, _ = private_broker(
        "--max-ranks", "1", "--timings-file", str(history),
        "--adaptive-timeout", "--adaptive-k", "3", "--adaptive-floor", "1",
    )  # fmt: skip
    release = tmp_path / "release"
    with Client(endpoint, name="test_status") as client:
        status = client.status()
        assert status["broker"]["adaptive_timeout"] is True
        assert status["broker"]["history_tests"] == 2
        assert status["pools"] == []  # idle with no groups at all
        # No history: the requested deadline. History below the floor: the floor.
        fresh = client.submit(NOOP, timeout=60, test_id="adaptive::fresh", **PRIVATE)
        quick = client.submit(NOOP, timeout=60, test_id="adaptive::quick", **PRIVATE)
        assert (fresh.outcome, fresh.deadline_s) == ("passed", 60), explain(fresh)
        assert (quick.outcome, quick.deadline_s) == ("passed", 1), explain(quick)
        # ...and history is learned as tasks finish: fresh has a passing run now.
        again = client.submit(NOOP, timeout=60, test_id="adaptive::fresh", **PRIVATE)
        assert again.deadline_s == 1
        # 3 x the slowest passing run (0.5 s): a run that holds longer hits the deadline,
        # the error says the deadline was learned, and the retry gets the requested one.
        slow = client.submit_async(
            HOLD, kwargs={"path": str(release)}, timeout=60, test_id="adaptive::slow", **PRIVATE
        )
        status = wait_for_status(
            client,
            "the retry of the slow task",
            lambda s: any((p["task"] or {}).get("attempt") == 2 for p in s["pools"]),
        )
        (task,) = [p["task"] for p in status["pools"] if p["task"]]
        assert task["deadline_s"] == 60 and task["deadline_note"] == ""
        release.touch()
        result = slow.result(timeout=60)
    assert result.outcome == "passed" and result.attempts == 2, explain(result)
    assert "deadline of 1.5s (learned: 3 \u00d7 slowest 0.5s) passed" in result.notes[0]
    # The broker appends the slow task's line after its verdict went out: wait for it.
    until = time.monotonic() + 30
    while True:
        recorded = [t for t in timings.read(history) if t.test_id.startswith("adaptive::")]
        if len(recorded) >= 7 or time.monotonic() > until:
            break
        time.sleep(0.05)
    assert [t.test_id for t in recorded][3:] == [
        "adaptive::fresh",
        "adaptive::quick",
        "adaptive::fresh",
        "adaptive::slow",
    ]
    assert recorded[-1].retries == 1 and recorded[-1].deadline_s == 60


def _timing(test_id: str, duration: float) -> dict[str, Any]:
    return {
        "finished_at": time.time(),
        "target": NOOP,
        "test_id": test_id,
        "spec": "ws1/gloo",
        "world_size": 1,
        "outcome": "passed",
        "duration_s": duration,
        "queue_s": 0.0,
        "attempts": 1,
        "retries": 0,
        "group_id": "g1",
        "deadline_s": 90.0,
    }


# --------------------------------------------------------------------------- shared broker


def test_timings_file_records_every_finished_task(
    client: Client, broker: str, broker_state: Path
) -> None:
    tag = f"timings-{os.getpid()}-{time.monotonic_ns()}"
    results = [client.submit(NOOP, 2, test_id=f"{tag}::noop") for _ in range(3)]
    results.append(client.submit("workers.collectives:fail_on_rank", 2, test_id=f"{tag}::fail"))
    assert [r.outcome for r in results] == ["passed"] * 3 + ["failed"]
    path = broker_state / "timings.jsonl"
    # The broker sends a verdict before it appends the history (docs/design.md "Dispatch"),
    # so the last line may land a moment after the verdict: wait for it, boundedly.
    deadline = time.monotonic() + 10
    while len(mine := [t for t in timings.read(path) if t.test_id.startswith(tag)]) < 4:
        assert time.monotonic() < deadline, mine
        time.sleep(0.02)
    assert [(t.test_id, t.outcome) for t in mine] == [(f"{tag}::noop", "passed")] * 3 + [
        (f"{tag}::fail", "failed")
    ]
    for timing, result in zip(mine, results, strict=True):
        assert timing.target in (NOOP, "workers.collectives:fail_on_rank")
        assert (timing.world_size, timing.spec, timing.attempts, timing.retries) == (
            2,
            "ws2/auto",
            1,
            0,
        )
        assert timing.group_id == result.group_id
        assert timing.duration_s == pytest.approx(result.duration_s)
        assert timing.queue_s >= 0 and timing.finished_at <= time.time()

    proc = cli(broker, broker_state, "status", "--timings", "--json", "--top", "2")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    (noop,) = [t for t in summary["tests"] if t["test"] == f"{tag}::noop"]
    assert (noop["runs"], noop["passed"], noop["failed"]) == (3, 3, 0)
    assert noop["p50_s"] <= noop["p95_s"] <= noop["max_s"]
    assert len(summary["slowest"]) == 2
    screen = cli(broker, broker_state, "status", "--timings", "--file", str(path))
    assert screen.returncode == 0, screen.stderr
    assert f"{tag}::noop" in screen.stdout and "slowest runs:" in screen.stdout

    status = client.status()
    (pool,) = [p for p in status["pools"] if p["id"] == results[0].group_id]
    assert pool["state"] in ("idle", "busy") and pool["tasks_done"] >= 1
    assert pool["last_heartbeat_s"] < 5 and all(m > 50 for m in pool["rss_mb"])
    assert pool["cuda_mb"] == [0.0, 0.0]  # gloo on CPU


@pytest.fixture
def ctrl_c_reaches_children() -> Iterator[None]:
    """Let the children of this test take SIGINT as a person's Ctrl-C.

    A shell starts background jobs (``cmd &``) with SIGINT ignored, and an ignored signal
    stays ignored across exec: a suite started that way would spawn children that cannot
    be interrupted. A handled signal is reset to the default at exec, so handle it here.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_reaches_children")
def test_watch_redraws_in_place(broker: str) -> None:
    """On a terminal --watch overwrites the previous screen; piped, it prints frames."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "cpq", "status", "--endpoint", broker, "--watch", "0.1"],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=subprocess.PIPE,
    )
    os.close(follower)
    output = b""
    deadline = time.monotonic() + 30
    try:
        while output.count(b"totals (tasks") < 3 and time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1)
            if ready:
                output += os.read(leader, 65536)
        process.send_signal(signal.SIGINT)
        # Keep reading, as a terminal does: a full pty would block its last writes.
        stop_by = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < stop_by:
            ready, _, _ = select.select([leader], [], [], 0.1)
            if ready:
                with contextlib.suppress(OSError):  # EIO once the last writer is gone
                    output += os.read(leader, 65536)
        if process.poll() is None:
            process.kill()
            pytest.fail(f"--watch ignored SIGINT for 10 s: {process.communicate()[1]!r}")
        assert process.returncode == 0, process.stderr.read()  # type: ignore[union-attr]
    finally:
        if process.poll() is None:
            process.kill()
        os.close(leader)
    assert output.count(b"totals (tasks") >= 3, output
    assert output.count(b"\x1b[2J") == 1  # the screen is cleared once, then overwritten
    assert output.count(b"\x1b[H") >= 3 and b"\x1b[J" in output

    piped = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cpq",
            "status",
            "--endpoint",
            broker,
            "--watch",
            "0.1",
            "--json",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert piped.stdout is not None
    lines = [piped.stdout.readline() for _ in range(2)]
    piped.send_signal(signal.SIGINT)
    assert piped.wait(timeout=10) == 0
    assert all(json.loads(line)["broker"]["endpoint"] == broker for line in lines)


# --------------------------------------------------------------------------- no broker


def test_timings_summary_and_a_log_that_cannot_be_written(tmp_path: Path) -> None:
    path = tmp_path / "timings.jsonl"
    line = len(json.dumps(_timing("t::b", 0.1), sort_keys=True)) + 1
    log = TimingsLog(path, max_bytes=50 * line)  # 81 lines: rotates exactly once
    for n in range(1, 21):
        timing = timings.TaskTiming(**{**_timing("t::a", n / 10), "outcome": "passed"})
        assert log.append(timing)
    assert log.append(timings.TaskTiming(**{**_timing("t::a", 99.0), "outcome": "error"}))
    with path.open("a") as out:
        out.write("not json\n[1, 2]\n")
    summary = timings.summarize(timings.read(path), top=3)
    (entry,) = summary["tests"]
    assert (entry["runs"], entry["passed"], entry["errors"]) == (21, 20, 1)
    # nearest rank over 0.1..2.0 (the error's 99 s is the deadline's, not the test's)
    assert (entry["p50_s"], entry["p95_s"], entry["max_s"]) == (1.0, 1.9, 2.0)
    assert [t["duration_s"] for t in summary["slowest"]] == [2.0, 1.9, 1.8]

    for _ in range(60):  # past max_bytes the log rotates to .1, and readers read both
        log.append(timings.TaskTiming(**_timing("t::b", 0.1)))
    assert Path(f"{path}.1").exists() and path.stat().st_size < 50 * line
    assert sum(1 for t in timings.read(path) if t.test_id == "t::b") == 60

    full = TimingsLog(Path("/dev/full"))
    assert not full.append(timings.TaskTiming(**_timing("t::c", 0.1)))
    assert full.errors == 1


def test_bad_warm_spec_is_a_usage_error(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    proc = cli(f"ipc://{state / 'b.sock'}", state, "broker", "--warm", "two-ranks=1")
    assert proc.returncode == 4
    assert "is not SPEC=N" in proc.stderr


def test_no_broker_is_reported_at_once_and_as_cpq_up_0(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'nobody.sock'}"
    plain = cli(endpoint, None, "status")
    scrape = cli(endpoint, None, "status", "--prometheus")
    assert plain.returncode == scrape.returncode == 2
    # Said from the endpoint's lock, before any connect: not a connect time-out's "cannot
    # connect" (a wall-clock bound here failed on a loaded box; the words are exact).
    assert f"no cpq broker runs at {endpoint}" in plain.stderr
    assert "cannot connect" not in plain.stderr + scrape.stderr
    (family,) = text_string_to_metric_families(scrape.stdout)
    assert (family.name, family.samples[0].value) == ("cpq_up", 0)


def test_rank_reports_leave_out_fields_an_older_broker_cannot_read() -> None:
    """An embedded broker outlives upgrades: a newer rank must still report to it."""
    from cpq import protocol
    from cpq.broker.supervisor import GroupProcess

    done = protocol.RankDone(
        task_id="t",
        result=protocol.RankResult(rank=0, outcome="passed"),
        rss_mb=300.0,
        cuda_mb=1.0,
        cuda_reserved_mb=2.0,
    )
    ready = protocol.RankReady(rank=0, startup_s=1.0, rss_mb=300.0)
    old_broker = frozenset()  # spawned us without CPQ_BROKER_FEATURES
    assert set(protocol.unpack(protocol.encode_for(done, old_broker))) == {
        "v", "k", "task_id", "result", "rss_mb",
    }  # fmt: skip
    assert set(protocol.unpack(protocol.encode_for(ready, old_broker))) == {
        "v", "k", "rank", "startup_s",
    }  # fmt: skip
    spec = protocol.PoolSpec(world_size=1, python=sys.executable, roots=[str(ROOT)])
    group = GroupProcess("g1", spec, "gloo", [], "ipc:///x", 1.0, 5, ROOT)
    features = frozenset(group.environment()[protocol.FEATURES_ENV].split(","))
    assert protocol.decode(protocol.encode_for(done, features)) == done
    assert protocol.decode(protocol.encode_for(ready, features)) == ready


def test_with_no_broker_the_cli_answers_at_once_and_status_json_is_still_json(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    endpoint = f"ipc://{state / 'broker.sock'}"
    for command in (["stop"], ["drain"], ["stop", "--drain"]):
        done = cli(endpoint, state, *command)
        assert done.returncode == 0 and "no cpq broker runs" in done.stdout, done
    status = cli(endpoint, state, "status", "--json")
    assert status.returncode == 2
    document = json.loads(status.stdout)
    assert document["broker"] is None and document["pools"] == [] and document["error"]


def test_stop_says_stopped_once_the_broker_and_its_groups_are_gone(tmp_path: Path) -> None:
    """A script that runs ``cpq stop`` and then starts a broker on the same endpoint must
    not find the old one still stopping its groups (it used to answer ~10 s early)."""
    state = tmp_path / "state"
    process, endpoint = start_broker(state)
    try:
        with Client(endpoint, name="stop-test") as client:
            assert client.submit(NOOP, **PRIVATE).outcome == "passed"
            ranks = [pid for pool in client.status()["pools"] for pid in pool["rank_pids"]]
        done = cli(endpoint, state, "stop")
        assert done.returncode == 0 and "broker stopped" in done.stdout, done
        assert not broker_alive(endpoint)  # at once: nothing holds the endpoint any more
        assert process.wait(timeout=5) == 0
        alive = [p for p in _procs(ranks) if p.is_running() and p.status() != "zombie"]
        assert ranks and not alive  # its spare's too; a zombie has exited, awaiting its reaper
        again, endpoint_again = start_broker(state)  # the endpoint is free at once
        stop_broker(again)
        assert endpoint_again == endpoint
    finally:
        stop_broker(process)
