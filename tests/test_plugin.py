"""Acceptance tests of the pytest plugin through ``pytester`` (real pytest sessions, real
broker, real torchrun groups). Each ``runpytest_subprocess`` is a separate pytest process,
the way a user runs it; they all talk to the session's shared broker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpq import Client, timings

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]

SUITE = """
import os
import pytest
import torch
import torch.distributed as dist


@pytest.mark.cpq(world_size=2)
def test_all_reduce():
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.cpq(world_size=2)
def test_rank1_fails():
    rank = dist.get_rank()
    print(f"output of rank {rank}")
    assert rank != 1, "rank one disagrees"


@pytest.mark.cpq(world_size=2)
def test_inline_skip():
    if dist.get_world_size() == 2:
        pytest.skip("needs a bigger world")


@pytest.mark.skipif(True, reason="skipif is evaluated locally")
@pytest.mark.cpq(world_size=2)
def test_skipif():
    raise AssertionError("must not run")


@pytest.mark.cpq(world_size=2)
@pytest.mark.parametrize("n", range(6))
def test_param(n):
    t = torch.tensor([float(n)])
    dist.all_reduce(t)
    assert t.item() == 2 * n


@pytest.mark.cpq(world_size=2)
@pytest.mark.parametrize("obj", [object()], ids=["object"])
def test_unserialisable_param(obj):
    pass


@pytest.mark.cpq(world_size=2)
def test_local_fixture_refused(tmp_path):
    pass


def test_fixture_style(cpq):
    result = cpq.run("workers.collectives:all_reduce_check", world_size=2, numel=4)
    assert result.value["sum"] == 3.0


@pytest.mark.cpq(world_size=2)  # with the fixture, the marker only declares (and warms) the pool
def test_fixture_style_with_declared_pool(cpq):
    result = cpq.run("workers.collectives:rank_info")
    assert result.value["world_size"] == 2
"""


@pytest.fixture
def suite_env(broker: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Sessions see the shared broker and can import this repository's ``workers``."""
    monkeypatch.setenv("CPQ_ENDPOINT", broker)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    return broker


def test_marker_suite_reads_like_local_pytest(pytester: pytest.Pytester, suite_env: str) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=11, failed=1, skipped=2)
    out = result.stdout.str()
    # The failing rank's own traceback is the long repr, with pytest's assertion explanation.
    assert "failed on rank(s) [1]" in out
    assert 'assert rank != 1, "rank one disagrees"' in out
    assert "AssertionError: rank one disagrees" in out
    # Every rank's output is in the report, each line saying its rank.
    assert "Captured stdout call" in out
    assert "[rank 0] output of rank 0" in out and "[rank 1] output of rank 1" in out
    assert "needs a bigger world" in out
    assert "skipif is evaluated locally" in out
    # Every test reached the ranks, all on one group: parameters of any kind and fixtures
    # such as tmp_path live in the ranks' own pytest sessions, and skip marks are evaluated
    # there, as in a fresh torchrun -m pytest.
    match = re.search(r"cpq: (\d+) task\(s\) on (\d+) group\(s\)", out)
    assert match is not None, out
    assert match.groups() == ("14", "1")


FLAKY_INFRA = """
import os
import signal
import pytest
import torch.distributed as dist

MARKER = {marker!r}


@pytest.mark.cpq(world_size=2, env={{"CPQ_TEST_POOL": "plugin-faults"}})
def test_survives_a_dead_rank():
    if dist.get_rank() == 1 and not os.path.exists(MARKER):
        open(MARKER, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_retry_note_reaches_junit_system_err(
    pytester: pytest.Pytester, suite_env: str, tmp_path: Path
) -> None:
    marker = tmp_path / "killed-once"
    pytester.makepyfile(test_flaky=FLAKY_INFRA.format(marker=str(marker)))
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_logging=system-err"
    )
    result.assert_outcomes(passed=1)
    assert marker.exists(), "the fault was never injected"
    xml = junit.read_text()
    system_err = re.search(r"<system-err>(.*?)</system-err>", xml, re.S)
    assert system_err is not None, xml
    assert "[CPQ-RETRY]" in system_err.group(1)
    assert "1 retry" in result.stdout.str()


XDIST_SUITE = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.cpq(world_size=2)
@pytest.mark.parametrize("n", range(8))
def test_sum(n, tmp_path):  # tmp_path: each rank's own, under the xdist worker's basetemp
    t = torch.tensor([float(n + dist.get_rank())])
    dist.all_reduce(t)
    assert t.item() == 2 * n + 1
    (tmp_path / "sum").write_text(str(t.item()))
"""


def test_xdist_workers_share_one_broker(pytester: pytest.Pytester, suite_env: str) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(test_x=XDIST_SUITE)
    with Client(suite_env) as client:
        before = client.status()
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=8)
    with Client(suite_env) as client:
        after = client.status()
    # Both workers were clients of the one shared broker: it ran each of the 8 tests once
    # (its history, by this project: other tests of this suite submit there meanwhile; the
    # status round trip above comes after the broker wrote the last of them).
    assert after["broker"]["pid"] == before["broker"]["pid"]
    history = Path(os.environ["CPQ_STATE_DIR"]) / timings.TIMINGS_FILE
    project = os.path.realpath(pytester.path)
    # a record of no project (a launch with no roots) is nobody's: realpath("") is the cwd
    mine = [t for t in timings.read(history) if t.project]
    ran = [t.test_id for t in mine if os.path.realpath(t.project) == project]
    assert sorted(ran) == sorted(f"test_x.py::test_sum[{n}]" for n in range(8))
    # ...and groups are counted per spec: at most one per concurrently submitting worker.
    match = re.search(r"cpq: (\d+) task\(s\) on (\d+) group\(s\)", result.stdout.str())
    assert match is not None, result.stdout.str()
    assert match.group(1) == "8"
    assert 1 <= int(match.group(2)) <= 2


RACE_TEST = """
import pytest
import torch.distributed as dist


@pytest.mark.cpq(world_size=2)
def test_rank():
    assert dist.get_world_size() == 2
"""


def test_autostart_race_ends_with_one_broker(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.delenv("CPQ_ENDPOINT", raising=False)
    monkeypatch.setenv("CPQ_STATE_DIR", str(state))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(test_race=RACE_TEST)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_race.py"]
    sessions = [
        subprocess.Popen(
            command, cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for _ in range(2)
    ]
    outputs = [s.communicate(timeout=240)[0].decode() for s in sessions]
    endpoint = f"ipc://{state / 'broker.sock'}"
    try:
        for session, output in zip(sessions, outputs, strict=True):
            assert session.returncode == 0, output
        log = (state / "logs" / "broker-autostart.log").read_text()
        assert log.count("serving ipc://") == 1, log
        with Client(endpoint) as client:
            status = client.status()
        assert status["totals"]["submitted"] == 2
        # One group per session at most (and maybe a spare): the two sessions' tests may
        # overlap, and a task that waits past --scale-up-after gets a group of its own.
        assert 1 <= log.count("starting group ") <= 2, log
    finally:
        subprocess.run(
            [sys.executable, "-m", "cpq", "stop", "--endpoint", endpoint],
            env=dict(os.environ),
            capture_output=True,
            timeout=30,
        )


COLLECT_FIRST = """
import pytest


@pytest.mark.cpq(world_size=1, env={{"CPQ_COLLECT_PROBE": "{probe}"}})
def test_first():
    pass
"""

COLLECT_LATER = """
import json
import os

from cpq import Client

# Imported while pytest collects, after test_a.py's test was collected: is its group
# already starting? (The ranks collect this module too, as torchrun -m pytest's do: they
# leave the answer alone.)
if "RANK" not in os.environ:
    with Client(os.environ["CPQ_ENDPOINT"]) as client:
        pools = client.status()["pools"]
    groups = [p["state"] for p in pools if p["env"].get("CPQ_COLLECT_PROBE") == "{probe}"]
    with open("{out}", "w") as handle:
        json.dump(groups, handle)


def test_later():
    pass
"""


def test_a_group_starts_while_the_rest_of_the_suite_is_collected(
    pytester: pytest.Pytester, suite_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first test of a session should not wait a whole spawn: its spec's group is asked
    for the moment its first test is collected. ``--collect-only`` starts nothing, and
    neither does a run whose options may deselect the test (``-k``)."""
    import json

    from conftest import start_broker

    from cpq.client.autostart import stop_broker

    # A broker of its own: the shared one may have no free room, and warming never evicts.
    process, endpoint = start_broker(tmp_path / "state", "--max-ranks", "2", "--spares", "0")
    monkeypatch.setenv("CPQ_ENDPOINT", endpoint)

    def groups(probe: str) -> list[str]:
        with Client(endpoint) as client:
            pools = client.status()["pools"]
        return [p["state"] for p in pools if p["env"].get("CPQ_COLLECT_PROBE") == probe]

    try:
        for probe, flags in (("collect-only", ["--collect-only"]), ("k", ["-k", "later"])):
            out = tmp_path / f"{probe}.json"
            pytester.makepyfile(
                test_a=COLLECT_FIRST.format(probe=probe),
                test_b=COLLECT_LATER.format(probe=probe, out=out),
            )
            result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *flags)
            assert result.ret == 0, result.stdout.str()
            assert json.loads(out.read_text()) == [] and groups(probe) == []
        out = tmp_path / "run.json"
        pytester.makepyfile(
            test_a=COLLECT_FIRST.format(probe="run"),
            test_b=COLLECT_LATER.format(probe="run", out=out),
        )
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
        result.assert_outcomes(passed=2)
        during = json.loads(out.read_text())
        assert during and set(during) <= {"starting", "idle"}, during
    finally:
        stop_broker(process)


RANK_OUTPUT = """
import torch.distributed as dist
import pytest


@pytest.mark.cpq(world_size=2)
def test_talks():
    print(f"hello from {dist.get_rank()}")
"""


def test_dash_s_prints_each_ranks_output_with_its_rank(
    pytester: pytest.Pytester, suite_env: str
) -> None:
    """With ``-s`` (no capture) each rank's output reaches the terminal after the task, every
    line labelled with its rank (README "Reports": not live)."""
    pytester.makepyfile(test_talks=RANK_OUTPUT)
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out


HOLDER = """
import os, time
import pytest


@pytest.mark.cpq(world_size=1, env={"CPQ_TEST_POOL": "holder"})
def test_hold():
    open(os.environ["MYPROJ_HELD"], "a").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["MYPROJ_RELEASE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
"""

WAITER = """
import pytest


def test_here():
    pass


@pytest.mark.cpq(world_size=1, env={"CPQ_TEST_POOL": "waiter"})
def test_wait():
    pass
"""


@pytest.mark.parametrize("verbosity", [[], ["-q"]], ids=["default", "quiet"])
def test_a_test_that_waits_for_a_group_says_why(tmp_path: Path, verbosity: list[str]) -> None:
    """A broker with one core for busy ranks (--max-ranks 1), held by another session's busy
    group: the waiting test says why on the terminal after 3 s (README), then runs once
    freed. The notice is a line of its own and pytest's progress line goes on after it as
    pytest starts one (the file's name, then the letters), never a letter alone."""
    from conftest import start_broker, stop_broker

    process, endpoint = start_broker(tmp_path / "state", "--max-ranks", "1", "--spares", "0")
    try:
        (tmp_path / "holder").mkdir()
        (tmp_path / "waiter").mkdir()
        (tmp_path / "holder" / "test_hold.py").write_text(HOLDER)
        (tmp_path / "waiter" / "test_wait.py").write_text(WAITER)
        held, release = tmp_path / "held", tmp_path / "release"
        env = dict(
            os.environ,
            CPQ_ENDPOINT=endpoint,
            PYTHONPATH=str(ROOT),
            MYPROJ_HELD=str(held),
            MYPROJ_RELEASE=str(release),
        )
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-s",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
        ]
        holder = subprocess.Popen([*command, "-q"], cwd=tmp_path / "holder", env=env)
        deadline = time.monotonic() + 120
        while not held.exists():
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        waiter = subprocess.Popen(
            [*command, *verbosity],
            cwd=tmp_path / "waiter",
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert waiter.stdout is not None
        lines = []
        for line in waiter.stdout:  # until the notice: then free the room
            lines.append(line)
            if "waiting for a ws1" in line:
                break
        release.touch()
        rest, _ = waiter.communicate(timeout=120)
        out = "".join(lines) + rest
        assert holder.wait(timeout=60) == 0
        assert waiter.returncode == 0, out
        # its group starts (an idle rank costs no core) but its rank finds no free core
        group = r"(none yet|1 starting|1 idle, waiting for cores)"
        why = rf"waiting for a ws1/\S+ CPQ_TEST_POOL=waiter group \(\w+\): {group}; 0 of 1 CPU"
        assert re.search(why, out), out
        # -s shows the ranks' stderr: building their session warns nothing (argparse did)
        assert "Do not expect" not in out, out
        # what the ranks wrote to stderr (-s shows it after the test's prefix) aside
        shown = re.sub(r"\[rank \d+\].*\n?", "", out).splitlines()
        notices = [i for i, line in enumerate(shown) if "waiting for a ws1" in line]
        assert all(shown[i].startswith("cpq: waiting for a ws1") for i in notices), out
        before, after = shown[notices[0] - 1], shown[notices[-1] + 1]
        if verbosity:  # -q: the letters, then the notice, then the next letter
            assert (before, after[:1]) == (".", "."), out
        else:  # test_here's progress line, then test_wait's
            assert before == "test_wait.py ." and after.startswith("test_wait.py ."), out
    finally:
        stop_broker(process)


OWN_TIME = """
import time


def test_calls_the_ranks(cpq):
    pool = {{"CPQ_TEST_POOL": "own-time-{tag}"}}  # a spec of its own: its group starts cold
    start = time.perf_counter()
    assert cpq.run("workers.collectives:rank_info", 1, env=pool).outcome == "passed"
    print(f"BODY_WALL {{time.perf_counter() - start:.4f}}")
"""


def test_a_cpq_run_test_reports_its_own_time_and_the_wait_apart(
    pytester: pytest.Pytester, suite_env: str
) -> None:
    """A body that calls ``cpq.run`` waits for its group inside its call; JUnit's ``time``
    (and ``--durations``) give the body's own time, the wait is a property of its own."""
    import uuid
    import xml.etree.ElementTree as ET

    pytester.makepyfile(test_own_time=OWN_TIME.format(tag=uuid.uuid4().hex))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--junitxml=junit.xml", "--durations=0", "-vv", "-s"
    )
    result.assert_outcomes(passed=1)
    (case,) = ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    waited = float(props["cpq_spawn_wait_s"])
    assert waited > 1.0, props  # a cold group's spawn
    out = result.stdout.str()
    call = re.search(r"([0-9.]+)s call +test_own_time.py::test_calls_the_ranks", out)
    body = re.search(r"BODY_WALL ([0-9.]+)", out)
    assert call and body, out
    # the call's duration is the body's wall time less the measured wait (timer resolution)
    assert float(call[1]) <= float(body[1]) - waited + 0.05, (out, props, body[1])
    assert float(case.get("time", "nan")) < float(body[1]), (case.attrib, props)
