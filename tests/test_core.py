"""cpq's core contract, end to end: a real broker, real torchrun groups (gloo on CPU).

Every test talks to the session's broker (``broker``/``client`` in conftest.py) the way a
user would, and checks what a user would look at: the outcome, each rank's report, the
notes, the exit code of a command. The shared warm ws=2 group serves the well-behaved
tasks; tests that kill or hang a group use a pool spec of their own (an ``env`` override),
so the shared group survives them. A group start costs ~10 s on a small node, so the
module starts the fault pools' groups up front (in parallel with the shared one) and the
fault tests are ordered to reuse the group a previous retry left warm.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest
import zmq
from conftest import ROOT, broker_reply, start_broker, stop_broker

from cpq import BadRequest, Client, EncodeError, protocol
from cpq.protocol import RETRY_FAIL_NOTE, RETRY_NOTE, RankResult, TaskResult
from cpq.specs import make_spec

WS = 2
#: A pool spec for tests that kill groups (sigkill, peer failure, leaks, mutations).
FAULTS = {"CPQ_TEST_POOL": "faults"}
#: A second one for the deadline test, so both fault groups can start up front.
DEADLINE = {"CPQ_TEST_POOL": "faults-deadline"}
NOOP = "workers.collectives:noop"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module", autouse=True)
def warm_pools(broker: str) -> None:
    """Start the shared group and both fault pools' groups at once (they start in parallel)."""
    with Client(broker, name="test_core-warm") as warm:
        warm.warm([make_spec(WS), make_spec(WS, FAULTS), make_spec(WS, DEADLINE)])


def explain(result: TaskResult) -> str:
    """A verdict in a few lines, for assertion messages."""
    lines = [f"outcome={result.outcome} attempts={result.attempts} message={result.message!r}"]
    lines += [f"note: {note}" for note in result.notes]
    for rank in result.ranks:
        lines.append(f"rank {rank.rank}: {rank.outcome} {rank.error}")
        lines += [f"  stdout: {rank.stdout[-500:]!r}", f"  stderr: {rank.stderr[-500:]!r}"]
    return "\n".join(lines)


def by_rank(result: TaskResult) -> dict[int, RankResult]:
    assert sorted(r.rank for r in result.ranks) == list(range(WS)), explain(result)
    return {r.rank: r for r in result.ranks}


def retry_notes(result: TaskResult) -> list[str]:
    return [n for n in result.notes if RETRY_NOTE in n or RETRY_FAIL_NOTE in n]


# --------------------------------------------------------------------------- outcomes


def test_passing_task_returns_rank_zeros_value(client: Client) -> None:
    result = client.submit("workers.collectives:all_checks", WS)
    assert result.outcome == "passed", explain(result)
    ranks = by_rank(result)
    assert all(r.outcome == "passed" and r.error is None for r in ranks.values())
    assert result.value == {
        "all_reduce": {"rank": 0, "world_size": 2, "sum": 3.0},
        "all_gather": {"rank": 0, "gathered": 2},
        "broadcast": {"rank": 0, "src": 0},
    }
    assert ranks[1].value["all_reduce"]["rank"] == 1
    assert result.attempts == 1
    assert result.notes == []


def test_a_ready_rank_froze_what_it_held(client: Client) -> None:
    """The check after every caller is a full garbage collection; what the ready rank holds
    (torch and its preloads) is frozen out of it, or it would walk them all (~0.1 s a
    launch with torch loaded, most of a warm launch on the H200 host)."""
    result = client.submit("workers.collectives:rank_info", WS)
    assert result.outcome == "passed", result.message
    frozen = [rank.value["frozen_objects"] for rank in result.ranks]
    assert len(frozen) == WS and min(frozen) > 10_000, frozen  # torch alone has more


def test_assertion_on_one_rank_fails_with_that_ranks_traceback(client: Client) -> None:
    result = client.submit("workers.collectives:fail_on_rank", WS, {"rank": 1, "message": "boom"})
    assert result.outcome == "failed", explain(result)
    ranks = by_rank(result)
    assert ranks[0].outcome == "passed"
    assert ranks[1].outcome == "failed"
    assert result.failed_ranks == [ranks[1]]
    error = ranks[1].error
    assert error is not None
    assert error.type == "AssertionError"
    assert error.message == "boom on rank 1"
    assert "in fail_on_rank" in error.traceback
    assert "workers/collectives.py" in error.traceback
    assert "cpq/rank/" not in error.traceback  # the traceback starts at the user's code
    assert result.attempts == 1
    assert retry_notes(result) == []


def test_skip_inside_the_task_is_skipped_with_the_reason(client: Client) -> None:
    result = client.submit(
        "workers.collectives:skip_everywhere", WS, {"reason": "needs 8 GPUs, found none"}
    )
    assert result.outcome == "skipped", explain(result)
    assert result.message == "needs 8 GPUs, found none"
    assert all(r.outcome == "skipped" for r in result.ranks)
    assert result.attempts == 1


@pytest.mark.parametrize(
    ("target", "error_type", "words"),
    [
        (
            "cpq_no_such_module.sub:main",
            "ModuleNotFoundError",
            "No module named 'cpq_no_such_module'",
        ),
        ("workers.collectives:no_such_function", "AttributeError", "no_such_function"),
    ],
    ids=["missing-module", "missing-function"],
)
def test_unimportable_target_fails_without_retry(
    client: Client, target: str, error_type: str, words: str
) -> None:
    result = client.submit(target, WS)
    assert result.outcome == "failed", explain(result)
    for rank in by_rank(result).values():
        assert rank.outcome == "failed"
        assert rank.error is not None
        assert rank.error.type == error_type
        assert words in rank.error.message
    assert result.attempts == 1
    assert retry_notes(result) == []


@pytest.mark.parametrize(
    ("target", "world_size", "timeout", "words"),
    [
        (NOOP, 0, None, "world_size must be at least 1, got 0"),
        (NOOP, -1, None, "world_size must be at least 1, got -1"),
        (NOOP, 10**6, None, "world_size 1000000 exceeds"),
        ("workers.collectives.noop", WS, None, "must look like 'package.module:function'"),
        (":noop", WS, None, "must look like 'package.module:function'"),
    ],
    ids=["ws0", "ws-1", "ws1e6", "no-colon", "no-module"],
)
def test_impossible_request_is_an_immediate_error(
    client: Client, target: str, world_size: int, timeout: float | None, words: str
) -> None:
    start = time.monotonic()
    result = client.submit(target, world_size, timeout=timeout)
    elapsed = time.monotonic() - start
    assert result.outcome == "error", explain(result)
    assert words in result.message
    assert result.ranks == []
    assert result.attempts == 1
    assert result.notes == []
    assert elapsed < 2.0, f"a request that can never run took {elapsed:.1f}s to be refused"


@pytest.mark.parametrize("timeout", [0.0, -5.0, math.nan, math.inf, "soon"])
def test_deadline_that_would_never_fire_is_refused_before_sending(
    broker: str, timeout: object
) -> None:
    """An infinite (or NaN) deadline would let one hung test hold its group for good. Counted
    on this client's own row: the shared broker's totals move with the other xdist worker's
    tests (a loaded run saw 15 == 14)."""
    name = f"refusal-{uuid.uuid4().hex[:8]}"
    with Client(broker, name=name) as client:
        with pytest.raises(BadRequest, match="timeout must be a"):
            client.submit(NOOP, WS, timeout=timeout)  # type: ignore[arg-type]
        rows = [row for row in client.status()["clients"] if row["name"] == name]
    assert [row["submitted"] for row in rows] == [0]


# --------------------------------------------------------------------------- state and output


def test_output_is_captured_per_rank_at_fd_level(client: Client) -> None:
    result = client.submit("workers.collectives:print_both", WS, {"text": "mark-7"})
    assert result.outcome == "passed", explain(result)
    for me, rank in by_rank(result).items():
        assert f"mark-7 from python on rank {me}\n" in rank.stdout
        assert f"mark-7 from fd1 on rank {me}\n" in rank.stdout
        assert f"mark-7 from fd2 on rank {me}\n" in rank.stderr
        assert "fd2" not in rank.stdout
        assert "fd1" not in rank.stderr and "python" not in rank.stderr
        assert f"rank {1 - me}" not in rank.stdout + rank.stderr
    # Capture is per task: the next task on the same group starts with empty streams.
    after = client.submit(NOOP, WS)
    assert after.group_id == result.group_id
    assert [(r.stdout, r.stderr) for r in after.ranks] == [("", "")] * WS


def test_environment_cwd_and_rng_do_not_leak_between_tasks(client: Client) -> None:
    first = client.submit("workers.collectives:pollute_state", WS)
    second = client.submit("workers.collectives:pollute_state", WS)
    reseeded = client.submit("workers.collectives:pollute_state", WS, seed=7)
    for result in (first, second, reseeded):
        assert result.outcome == "passed", explain(result)
    assert second.group_id == first.group_id  # the same warm processes
    baseline_cwd = os.path.realpath(os.getcwd())  # the group runs in the client's directory
    for a, b, c in zip(first.ranks, second.ranks, reseeded.ranks, strict=True):
        assert a.value["env"] is None and b.value["env"] is None
        assert a.value["cwd"] == b.value["cwd"] == baseline_cwd
        assert b.value["random"] == a.value["random"]
        assert b.value["torch"] == a.value["torch"]
        assert c.value["random"] != a.value["random"]  # the task's seed is honoured


def test_each_task_sees_the_callers_variables_of_its_submit(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unchanged variables travel once (docs/design.md, "Dispatch"), yet every task on the
    warm group sees exactly what the caller had when it submitted, also after a task that
    changed its own environment."""
    names = ["CPQ_TEST_FLAG", "CPQ_TEST_POLLUTION"]
    seen, group_ids = [], set()
    steps = ["a", "a", "pollute", "a", "b", None, None, "a"]
    for step in steps:
        if step == "pollute":
            result = client.submit("workers.collectives:pollute_state", WS)
        else:
            if step is None:
                monkeypatch.delenv("CPQ_TEST_FLAG", raising=False)
            else:
                monkeypatch.setenv("CPQ_TEST_FLAG", step)
            result = client.submit("workers.collectives:getenv", WS, {"names": names})
            seen.append({r.rank: r.value for r in result.ranks})
        assert result.outcome == "passed", explain(result)
        group_ids.add(result.group_id)
    expected = [s for s in steps if s != "pollute"]
    for ranks, flag in zip(seen, expected, strict=True):
        for rank in range(WS):
            assert ranks[rank] == {"CPQ_TEST_FLAG": flag, "CPQ_TEST_POLLUTION": None}
    assert len(group_ids) == 1  # one warm group throughout


def test_multicast_stays_off_whatever_the_caller_sets(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVLink multicast can take a shared host's GPUs out of service: every group runs with
    it off, also when the caller's shell or the task's ``env=`` turns it on."""
    names = sorted(protocol.MULTICAST_OFF_ENV)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the caller's shell
    result = client.submit(
        "workers.collectives:getenv",
        1,
        {"names": names},
        env={"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0", "NVSHMEM_DISABLE_NVLS": "0"},
    )
    assert result.outcome == "passed", explain(result)
    assert result.ranks[0].value == protocol.MULTICAST_OFF_ENV


def test_flooded_output_is_bounded_keeping_head_and_tail(client: Client) -> None:
    result = client.submit("workers.faults:flood_output", WS, {"megabytes": 20})
    assert result.outcome == "passed", explain(result)
    for me, rank in by_rank(result).items():
        assert rank.value > 20 * 2**20
        assert len(rank.stdout.encode()) <= protocol.MAX_CAPTURE_BYTES + 200
        assert rank.stdout.startswith(f"flood from rank {me} ")
        assert "bytes of output truncated" in rank.stdout
        assert rank.stdout.endswith(f"flood_output done on rank {me}\n")


def test_unserialisable_argument_is_refused_before_sending(client: Client) -> None:
    before = client.status()["totals"]["submitted"]
    with pytest.raises(EncodeError, match=r"argument 'payload' \(a object\) cannot be sent"):
        client.submit("workers.collectives:echo", WS, {"fine": 1, "payload": object()})
    assert client.status()["totals"]["submitted"] == before


def test_invalid_env_is_refused_before_sending(client: Client) -> None:
    with pytest.raises(BadRequest, match="env"):
        client.submit(NOOP, WS, env={"CPQ_TEST_POOL": 3})  # type: ignore[dict-item]
    with pytest.raises(BadRequest, match="NUL"):
        client.submit(NOOP, WS, env={"CPQ_TEST_POOL": "a\x00b"})


def test_unserialisable_return_value_fails_clearly(client: Client) -> None:
    result = client.submit("workers.faults:unserialisable_return", WS)
    assert result.outcome == "failed", explain(result)
    for rank in by_rank(result).values():
        assert rank.outcome == "failed"
        assert rank.error is not None
        assert "EncodeError" in rank.error.type
        assert "return value" in rank.error.message
        assert "workers.faults:unserialisable_return" in rank.error.message
        assert "object" in rank.error.message
    assert result.attempts == 1
    again = client.submit(NOOP, WS)  # a bad return value costs no group
    assert again.outcome == "passed" and again.group_id == result.group_id


# --------------------------------------------------------------------------- malformed input


def _wire(**fields: Any) -> bytes:
    return msgpack.packb({"v": protocol.PROTOCOL_VERSION, **fields}, use_bin_type=True)


def _spec(**changes: Any) -> dict[str, Any]:
    spec = {"world_size": WS, "python": sys.executable, "roots": [str(ROOT)], "env": []}
    return {**spec, **changes}


def _submit(**changes: Any) -> bytes:
    fields = {"k": "submit", "task_id": "raw-1", "target": NOOP, "spec": _spec(), **changes}
    return _wire(**fields)


@pytest.mark.parametrize(
    ("frames", "words"),
    [
        ([b"\xc1 not msgpack at all"], "not valid msgpack"),
        ([b""], "not valid msgpack"),
        ([msgpack.packb([1, 2, 3])], "must be a map"),
        ([msgpack.packb({"v": 99, "k": "status"})], "protocol version 99 not supported"),
        ([msgpack.packb({"k": "status"})], "protocol version None not supported"),
        ([_wire(k="launch_missiles")], "unknown message kind 'launch_missiles'"),
        ([_wire(k="status"), b"extra"], "exactly one payload frame"),
        ([_wire(k="status"), b"", b""], "exactly one payload frame"),
        ([_wire(k="submit")], "submit"),
        ([_submit(task_id=7)], "submit.task_id: expected str, got int"),
        ([_submit(spec=_spec(world_size="two"))], "submit.spec.world_size"),
        ([_submit(spec="ws2")], "submit.spec: expected a map"),
        ([_submit(kwargs=[1])], "submit.kwargs: expected a map"),
        ([_submit(surprise=1)], "'surprise'"),
        ([_submit(spec=_spec(env=[["CPQ_TEST_POOL"]]))], "env"),
        ([_submit(spec=_spec(env=[["A", "1", "2"]]))], "env"),
        ([_submit(spec=_spec(env=[["A", "a\x00b"]]))], "NUL"),
        ([_submit(spec=_spec(roots=["/tmp/\x00"]))], "NUL"),
        ([_submit(spec=_spec(python=sys.executable + "\x00"))], "NUL"),
        ([_wire(k="warm", specs=[_spec(env=[["A"]])])], "env"),
        ([_wire(k="rank_ready", rank=0)], "'rank_ready' is not a client message"),
    ],
    ids=[
        "garbage",
        "empty",
        "not-a-map",
        "wrong-version",
        "no-version",
        "unknown-kind",
        "extra-frame",
        "two-extra-frames",
        "missing-fields",
        "wrong-type",
        "wrong-nested-type",
        "spec-not-a-map",
        "kwargs-not-a-map",
        "unknown-field",
        "env-pair-too-short",
        "env-pair-too-long",
        "nul-in-env",
        "nul-in-roots",
        "nul-in-python",
        "warm-bad-env",
        "rank-message",
    ],
)
def test_malformed_message_gets_an_error_and_the_broker_keeps_serving(
    client: Client, raw_dealer: zmq.Socket[Any], frames: list[bytes], words: str
) -> None:
    raw_dealer.send_multipart(frames)
    reply = broker_reply(raw_dealer)
    assert reply["k"] == "error", reply
    assert words in reply["message"]
    assert client.submit(NOOP, WS).outcome == "passed"


def test_oversized_frame_is_dropped_and_the_broker_keeps_serving(
    client: Client, raw_dealer: zmq.Socket[Any]
) -> None:
    before = client.status()["broker"]["pid"]
    raw_dealer.send(b"\x00" * (protocol.MAX_FRAME_BYTES + 1))
    result = client.submit(NOOP, WS)
    assert result.outcome == "passed", explain(result)
    assert client.status()["broker"]["pid"] == before


# --------------------------------------------------------------------------- commands


def _command(broker: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CPQ_ENDPOINT=broker)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def _cpq(broker: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``cpq ARGS``, run by this interpreter so its pool spec is the shared group's.

    (The installed ``cpq`` script names ``python3.11`` where pytest may run as ``python``:
    another interpreter path, hence another pool spec and a group start of its own.)
    """
    return _command(broker, sys.executable, "-m", "cpq", *args)


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--world-size", "2", NOOP], 0),
        (["--world-size", "2", "workers.collectives:fail_on_rank", "rank=1"], 1),
        (["--world-size", "0", NOOP], 2),
        (["--world-size", "2", "workers.collectives:skip_everywhere", "reason=cli"], 3),
        ([NOOP], 4),
        (["--world-size", "two", NOOP], 4),
        (["--world-size", "2", "workers.collectives:echo", "not-key-value"], 4),
        (["--world-size", "2", "--env", "NO_VALUE", NOOP], 4),
        (["--world-size", "2", "--bogus-flag", NOOP], 4),
    ],
    ids=["passed", "failed", "error", "skipped", "no-ws", "bad-ws", "bad-kwarg", "bad-env", "flag"],
)
def test_cpq_submit_exit_codes(broker: str, args: list[str], code: int) -> None:
    proc = _cpq(broker, "submit", "--no-autostart", *args)
    assert proc.returncode == code, proc.stdout + proc.stderr
    if code == 4:
        assert proc.stderr.strip()  # bad usage says what was wrong


def test_cpq_submit_json_reads_values_as_json(broker: str) -> None:
    proc = _cpq(
        broker,
        "submit",
        "--no-autostart",
        "--world-size",
        "2",
        "--json",
        "workers.collectives:echo",
        "n=3",
        "flag=true",
        "name=abc",
        "items=[1,2]",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    verdict = json.loads(proc.stdout)
    assert verdict["outcome"] == "passed"
    expected = {"n": 3, "flag": True, "name": "abc", "items": [1, 2]}
    assert [r["value"] for r in verdict["ranks"]] == [expected, expected]


def test_cpq_status_json_has_the_documented_fields(broker: str, client: Client) -> None:
    assert client.submit(NOOP, WS).outcome == "passed"  # at least one warm pool with a task
    proc = _command(broker, str(BIN / "cpq-status"), "--json")  # the installed script
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert {"broker", "pools", "queue", "clients", "totals"} <= set(status)
    assert status["broker"]["endpoint"] == broker
    totals = status["totals"]
    counters = ("submitted", "passed", "failed", "skipped", "errors", "retries", "groups_started")
    assert all(isinstance(totals[name], int) for name in counters), totals
    assert totals["submitted"] >= totals["passed"] >= 1
    assert totals["groups_started"] >= 1
    pool_fields = {"id", "world_size", "backend", "gpus", "state", "pid", "tasks_done"}
    for pool in status["pools"]:
        assert pool_fields <= set(pool), pool
        assert pool["state"] in ("starting", "idle", "busy", "stopping")
        assert pool["backend"] == "gloo" and pool["gpus"] == []
    shared = [
        p
        for p in status["pools"]
        if p["spec"] == f"ws{WS}/auto" and p["state"] == "idle"  # no pinned variables
    ]
    assert shared and max(p["tasks_done"] for p in shared) >= 1
    assert isinstance(shared[0]["pid"], int)
    assert isinstance(status["queue"], list)
    assert {"pytest", "cpq-status"} <= {c["name"] for c in status["clients"]}


# --------------------------------------------------------------------------- faults


def _ready_pools(client: Client) -> list[dict[str, Any]]:
    """The pools once none is starting (a starting one lists only the ranks that said
    hello), idle or busy ones only (another worker's may be stopping)."""
    deadline = time.monotonic() + 60
    while True:
        pools = client.status()["pools"]
        if not any(p["state"] == "starting" for p in pools) or time.monotonic() > deadline:
            return [p for p in pools if p["state"] in ("idle", "busy")]
        time.sleep(0.1)


def _processes(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):  # a group stopping meanwhile
            found.append(psutil.Process(pid))
    return found


def _pool(client: Client, group_id: str) -> dict[str, Any]:
    pools = [p for p in client.status()["pools"] if p["id"] == group_id]
    assert pools, f"group {group_id} is not in the broker's status"
    return pools[0]


def test_replaced_sys_streams_and_state_are_restored(client: Client) -> None:
    first = client.submit("workers.faults:mutate_global_state", WS, env=FAULTS)
    second = client.submit("workers.faults:mutate_global_state", WS, env=FAULTS)
    printed = client.submit("workers.collectives:print_both", WS, {"text": "after"}, env=FAULTS)
    for result in (first, second, printed):
        assert result.outcome == "passed", explain(result)
    assert first.group_id == second.group_id == printed.group_id
    for a, b in zip(first.ranks, second.ranks, strict=True):
        assert b.value == a.value  # the second task found what the first one found
        assert b.value["env"] is None
        assert not b.value["stdout_closed"] and not b.value["stderr_closed"]
    for me, rank in by_rank(printed).items():
        assert f"after from python on rank {me}\n" in rank.stdout


def test_leaked_memory_shows_in_status(client: Client) -> None:
    base = client.submit(NOOP, WS, env=FAULTS)
    assert base.outcome == "passed", explain(base)
    before = _pool(client, base.group_id)["rss_mb"]
    leak = client.submit("workers.faults:leak_memory", WS, {"megabytes": 128}, env=FAULTS)
    assert leak.outcome == "passed", explain(leak)
    assert leak.group_id == base.group_id
    after = _pool(client, leak.group_id)["rss_mb"]
    growth = [a - b for a, b in zip(after, before, strict=True)]
    assert all(g >= 120 for g in growth), f"rss before {before} MB, after {after} MB"


def test_rank_killed_mid_task_is_retried_on_a_fresh_group(client: Client, tmp_path: Path) -> None:
    marker = tmp_path / "killed-once"
    result = client.submit(
        "workers.faults:sigkill",
        WS,
        {"rank": 1, "once_marker": str(marker)},
        env=FAULTS,
        timeout=60,
    )
    assert marker.exists()  # attempt 1 really struck
    assert result.outcome == "passed", explain(result)
    assert result.attempts == 2
    assert [r.value for r in result.ranks] == [{"rank": 0}, {"rank": 1}]
    assert len(result.notes) == 1 and result.notes[0].startswith(RETRY_NOTE), result.notes
    assert f"on group {result.group_id}:" not in result.notes[0]  # the retry ran elsewhere


def test_frozen_rank_is_caught_by_heartbeats_killed_and_retried(
    client: Client, tmp_path: Path
) -> None:
    warm = client.submit(NOOP, WS, env=FAULTS)
    assert warm.outcome == "passed", explain(warm)
    # Every ready group's ranks now: placement may run the task on another idle group of the
    # spec (a spare) than the one that served ``warm``; the note names the one it froze.
    ranks = {p["id"]: _processes(p["rank_pids"]) for p in _ready_pools(client)}
    marker = tmp_path / "stopped-once"
    result = client.submit(
        "workers.faults:sigstop",
        WS,
        {"rank": 1, "once_marker": str(marker)},
        env=FAULTS,
        timeout=60,
    )
    assert marker.exists()
    assert result.outcome == "passed", explain(result)
    assert result.attempts == 2
    assert len(result.notes) == 1 and result.notes[0].startswith(RETRY_NOTE), result.notes
    assert "heartbeat" in result.notes[0]  # liveness caught it, long before the deadline
    frozen_id = result.notes[0].split(" on group ", 1)[1].split(":", 1)[0]
    assert frozen_id in ranks, (frozen_id, ranks)  # a warm group, not one started for it
    assert result.group_id != frozen_id
    frozen_group = ranks[frozen_id]
    assert len(frozen_group) == WS, ranks  # every rank of it, or the check below is hollow
    # A stopped process ignores SIGTERM: the old group must still be gone (SIGKILL).
    deadline = time.monotonic() + 15
    while any(_running(p) for p in frozen_group) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(p) for p in frozen_group), frozen_group


def test_failure_while_a_peer_waits_in_a_collective_fails_fast(client: Client) -> None:
    warm = client.submit(NOOP, WS, env=FAULTS)  # a warm group: time the failure, not a start
    assert warm.outcome == "passed", explain(warm)
    start = time.monotonic()
    result = client.submit(
        "workers.faults:raise_while_peer_waits", WS, {"rank": 1}, env=FAULTS, timeout=60
    )
    elapsed = time.monotonic() - start
    assert result.outcome == "failed", explain(result)
    assert elapsed < 10, f"took {elapsed:.1f}s"
    ranks = by_rank(result)
    assert ranks[1].outcome == "failed"
    assert ranks[1].error is not None
    assert ranks[1].error.type == "AssertionError"
    assert "rank 1 fails while its peers wait in all_reduce" in ranks[1].error.message
    assert "in raise_while_peer_waits" in ranks[1].error.traceback
    assert ranks[0].outcome != "passed"
    assert ranks[0].error is not None
    assert "dist.all_reduce(torch.ones(1))" in ranks[0].error.traceback  # where it waited
    assert result.attempts == 1
    assert retry_notes(result) == []


def test_deadline_reports_every_ranks_stack_and_retries_once(client: Client) -> None:
    start = time.monotonic()
    result = client.submit(
        "workers.faults:hang_in_python", WS, {"seconds": 30}, env=DEADLINE, timeout=2
    )
    elapsed = time.monotonic() - start
    assert result.outcome == "error", explain(result)
    assert "deadline of 2s passed" in result.message
    sleeping_line = "time.sleep(seconds)  # hang_in_python sleeps here"
    for rank in range(WS):
        assert f"--- rank {rank} ---" in result.message
    assert result.message.count(sleeping_line) == WS, result.message
    assert result.attempts == 2
    assert len(result.notes) == 2, result.notes
    # Each note is one line; the stacks are said once, in the verdict (attempt 1 hung at
    # the same place, so its stacks are not repeated).
    assert result.notes[0].startswith(RETRY_NOTE) and "\n" not in result.notes[0]
    assert result.notes[1].startswith(RETRY_FAIL_NOTE) and "\n" not in result.notes[1]
    assert "attempt 1" not in result.message
    assert elapsed < 60


def test_sigkilled_broker_leaves_no_rank_process(tmp_path: Path) -> None:
    process, endpoint = start_broker(tmp_path / "state", "--max-ranks", "2", "--memory", "0")
    procs: list[psutil.Process] = []
    try:
        with Client(endpoint, name="orphan-check") as private:
            assert private.submit(NOOP, WS).outcome == "passed"
            (pool,) = private.status()["pools"]
        assert len(pool["rank_pids"]) == WS
        procs = [psutil.Process(pid) for pid in [pool["pid"], *pool["rank_pids"]]]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        deadline = time.monotonic() + 15
        alive = procs
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _running(p)]
            time.sleep(0.1)
        assert not alive, f"still running 15s after the broker died: {alive}"
    finally:
        if process.poll() is None:
            stop_broker(process)
        for proc in procs:  # never leave our own orphans behind, even when failing
            if _running(proc):
                proc.kill()


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# --------------------------------------------------------------------------- concurrency


def test_two_clients_at_once_each_get_their_own_results(broker: str) -> None:
    per_client = 20
    start_together = threading.Barrier(2)

    def run(who: int) -> list[TaskResult]:
        with Client(broker, name=f"thread-{who}") as mine:
            start_together.wait(timeout=30)
            futures = [
                mine.submit_async("workers.collectives:echo", WS, {"client": who, "n": n})
                for n in range(per_client)
            ]
            return [f.result(timeout=120) for f in futures]

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(run, range(2)))
    for who, results in enumerate(outcomes):
        assert [r.outcome for r in results] == ["passed"] * per_client
        expected = [{"client": who, "n": n} for n in range(per_client)]
        assert [r.value for r in results] == expected
        assert [r.ranks[1].value for r in results] == expected
        assert len({r.task_id for r in results}) == per_client
