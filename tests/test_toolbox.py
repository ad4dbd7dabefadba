"""The pytest toolbox sees a fresh run: reruns, pytest-timeout, --pdb, skips, JUnit, -qq.

Each test runs the same small user project (in pytester's directory) through cpq and, where
the body needs no process group, through a fresh run (``-p no:cpq``: the body runs in the
pytest process itself, rank 1 played by ``RANK=1``), and compares what the user sees. Real
broker, real torchrun groups (gloo), real ZeroMQ.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    VERDICTS_PLUGIN,
    fresh_verdicts,
    run_with_verdicts,
    start_broker,
    wait_for_status,
)

from cpq import Client

pytest_plugins = ["pytester"]

#: A body that stands for rank 1 in a fresh run (no process group there).
RANK = 'int(os.environ.get("RANK", "1"))'


def run(pytester: pytest.Pytester, *args: str, stdin: bytes = b"", timeout: float = 240) -> str:
    """One pytest session in a fresh process, its stdin scripted; stdout and stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=pytester.path,
        input=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
    )
    return done.stdout.decode(errors="replace")


@pytest.fixture
def private_broker(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """A broker of its own (one spare per spec, as by default): these tests stop groups."""
    from cpq.client.autostart import stop_broker

    process, endpoint = start_broker(tmp_path_factory.mktemp("toolbox-broker"), "--max-ranks", "4")
    monkeypatch.setenv("CPQ_ENDPOINT", endpoint)
    try:
        yield endpoint
    finally:
        stop_broker(process)


@pytest.fixture
def shared(broker: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("CPQ_ENDPOINT", broker)
    return broker


# --------------------------------------------------------------------------- reruns, timeout

HANG = """
import os
import time
import pytest

COUNT = {count!r}


@pytest.mark.cpq(world_size=2)
def test_hangs_on_rank_1():
    if os.environ.get("RANK", "0") == "0":
        with open(COUNT, "a") as f:
            f.write("attempt\\n")
    if {rank} == 1:
        if "RANK" not in os.environ:  # a fresh run in this process: the hang, ended
            pytest.fail("stands for a hang that a timeout ended")
        time.sleep(60)
"""


def attempts(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


#: Each rerun plugin alone: with both installed, flaky's protocol hook runs every test and
#: pytest-rerunfailures never reruns anything (a known clash of the two, not cpq's). The
#: hang is ended by the marker's deadline: pytest-timeout cancels its own timer at a test's
#: first failure, so a rerun of a hang is not timed by it (in a fresh run neither).
RERUNS = {
    "pytest-rerunfailures": ("", ("-p", "no:flaky", "--reruns", "2")),
    "flaky": ("@pytest.mark.flaky(max_runs=3)", ("-p", "no:rerunfailures")),
}


@pytest.mark.parametrize("plugin", sorted(RERUNS))
def test_reruns_give_a_fresh_runs_attempts(
    pytester: pytest.Pytester, private_broker: str, tmp_path: Path, plugin: str
) -> None:
    fresh, warm = tmp_path / "fresh", tmp_path / "warm"
    decorator, flags = RERUNS[plugin]

    def project(count: Path) -> str:
        body = HANG.format(count=str(count), rank=RANK)
        return body.replace(
            "@pytest.mark.cpq(world_size=2",
            f"{decorator}\n@pytest.mark.cpq(world_size=2, timeout=3",
        )

    pytester.makepyfile(test_hang=project(fresh))
    fresh_out = run(pytester, "-p", "no:cpq", *flags)
    pytester.makepyfile(test_hang=project(warm))
    out = run(pytester, *flags)
    assert attempts(fresh) == 3, fresh_out
    assert attempts(warm) == attempts(fresh), out  # reruns + 1, not (reruns + 1) x 2
    assert "1 failed" in out, out
    assert "deadline of 3s passed" in out, out  # and where each rank was:
    assert re.search(r"--- rank 1 ---\n.*test_hang\.py.*\n.*time\.sleep\(60\)", out), out
    assert "cpq-client-io" not in out and "client.py" not in out
    assert "[CPQ-RETRY]" not in out  # cpq's retry stepped aside
    match = re.search(r"cpq: 3 task\(s\) on (\d+) group\(s\), 0 retries", out)
    assert match is not None and match[1] == "3", out  # one group per attempt, no more
    # Three 3 s timeouts (a fresh spare or spawn each); never cpq's default 90 s deadline.
    assert "deadline of 90s" not in out and out.count("deadline of 3s passed") >= 1, out


def _cpq_verdicts(
    pytester: pytest.Pytester, common: list[str]
) -> tuple[dict[str, str], subprocess.CompletedProcess[str]]:
    """``pytest --cpq-world-size 2 COMMON`` in the project (``-p verdicts`` among them): the
    calling process's verdicts, and the run."""
    warm = run_with_verdicts(
        [sys.executable, "-m", "pytest", "--cpq-world-size", "2", *common],
        pytester.path / "cpq",
        pytester.path,
    )
    return json.loads((pytester.path / "cpq-client.json").read_text()), warm


ONCE_PER_PROCESS = """
import os
import pytest
{imports}

SEEN = []


def test_first():
    SEEN.append("first")


{decorator}
def test_last_fails_once_per_process():
    # Flaky as real tests are: the first attempt in a process fails (a cache still empty,
    # a counter), a rerun in the same process passes.
    SEEN.append("last")
    assert SEEN == ["first", "last", "last"], SEEN
"""

ONCE = {
    "pytest-rerunfailures": ("", "", ("-p", "no:flaky", "--reruns", "1")),
    "flaky": ("from flaky import flaky", "@flaky(max_runs=2)", ("-p", "no:rerunfailures")),
}


@pytest.mark.parametrize("plugin", sorted(ONCE))
def test_a_rerun_of_the_last_test_finds_its_modules_state(
    pytester: pytest.Pytester, shared: str, monkeypatch: pytest.MonkeyPatch, plugin: str
) -> None:
    """A rerun plugin reruns a test in the process that ran it: the session's last test,
    failing once per process, passes on its rerun in ``torchrun -m pytest``, each rank's
    module state kept. Under cpq its rerun found the modules imported afresh (the ranks had
    ended the session with its last test) and failed: a newcomer's trial found it."""
    imports, decorator, flags = ONCE[plugin]
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    monkeypatch.delenv("CPQ_WORLD_SIZE", raising=False)
    pytester.makepyfile(
        test_once=ONCE_PER_PROCESS.format(imports=imports, decorator=decorator),
        verdicts=VERDICTS_PLUGIN,
    )
    common = ["-p", "verdicts", "-p", "no:cacheprovider", "-p", "no:randomly", *flags]
    reference, fresh = fresh_verdicts(common, "fresh", pytester.path)
    assert reference == {
        "test_once.py::test_first": "passed",
        "test_once.py::test_last_fails_once_per_process": "passed",
    }, fresh.stdout[-3000:]
    got, warm = _cpq_verdicts(pytester, common)
    assert got == reference, warm.stdout[-4000:]
    assert "cpq: 3 task(s)" in warm.stdout, warm.stdout[-4000:]  # the rerun ran on the ranks


KEPT_FOR_THE_RERUN = """
import pytest

SETUPS = []


@pytest.fixture(scope="module")
def counter():
    SETUPS.append("setup")
    state = {"attempts": 0}
    yield state
    SETUPS.append("teardown")


def test_first(counter):
    assert counter["attempts"] == 0


MADE = []


@pytest.fixture(scope="class")
def resource():
    MADE.append("resource")
    return len(MADE)


class TestLastOfTheModule:
    def test_reruns_with_its_fixtures_and_a_fresh_instance(self, counter, resource):
        assert not hasattr(self, "touched")  # each attempt gets an instance of its own
        self.touched = True
        counter["attempts"] += 1
        assert (counter["attempts"], SETUPS, resource) == (2, ["setup"], 1)
"""

SETS_UP_TWICE = """
import pytest

CALLS = []


@pytest.fixture(scope="module")
def fails_once():
    CALLS.append("setup")
    if len(CALLS) == 1:
        raise RuntimeError("the first setup fails")
    return len(CALLS)


def test_its_fixture_runs_again(fails_once):
    assert fails_once == 2
"""


def test_a_failed_attempt_that_is_rerun_keeps_its_module_and_class_fixtures(
    pytester: pytest.Pytester, shared: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest-rerunfailures keeps a module's and a class's fixtures standing for the rerun
    of the module's last test (only the test's own are torn down), sets a failed fixture
    up again and gives the rerun a fresh instance of its class. Under cpq the ranks tore
    the module down before the rerun, which then failed: a newcomer's trial found it."""
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    monkeypatch.delenv("CPQ_WORLD_SIZE", raising=False)
    pytester.makepyfile(
        test_kept=KEPT_FOR_THE_RERUN, test_again=SETS_UP_TWICE, verdicts=VERDICTS_PLUGIN
    )
    common = ["-p", "verdicts", "-p", "no:cacheprovider", "-p", "no:randomly"]
    common += ["-p", "no:flaky", "--reruns", "1"]
    reference, fresh = fresh_verdicts(common, "fresh", pytester.path)
    assert set(reference.values()) == {"passed"}, fresh.stdout[-3000:]
    got, warm = _cpq_verdicts(pytester, common)
    assert got == reference, warm.stdout[-4000:]
    assert "2 rerun" in warm.stdout, warm.stdout[-4000:]


NEXT = """
import os
import time
import pytest


@pytest.mark.cpq(world_size=2)
def test_a_hang():
    if os.environ["RANK"] == "1":
        time.sleep(60)


@pytest.mark.cpq(world_size=2)
def test_next():
    pass
"""


def test_a_timed_out_test_leaves_the_next_one_a_warm_group(
    pytester: pytest.Pytester, private_broker: str
) -> None:
    # (not a file named test_next.py: -k matches module names too, and would run the hang)
    pytester.makepyfile(test_hang_then_next=NEXT)
    run(pytester, "-k", "test_next")  # the spec's group and its spare start
    with Client(private_broker) as client:
        wait_for_status(
            client,
            "a group and its spare",
            lambda s: sum(p["state"] == "idle" for p in s["pools"]) >= 2,
        )
    junit = pytester.path / "junit.xml"
    out = run(pytester, "--timeout", "2", f"--junitxml={junit}", "--durations=0", "-vv")
    assert "1 failed, 1 passed" in out, out
    assert "Timeout (>2.0s) from pytest-timeout." in out
    # JUnit's message is pytest-timeout's alone, as a fresh run's; the stacks are on stderr
    message = '<failure message="Failed: Timeout (&gt;2.0s) from pytest-timeout.">'
    assert message in junit.read_text()
    # rank 1's own pytest-timeout failed it where it was, as in a fresh rank (signal
    # method): the traceback's `>` and `E` lines, and its group served the next test
    assert ">           time.sleep(60)" in out, out
    assert "E           Failed: Timeout (>2.0s) from pytest-timeout." in out, out
    assert "the group was stopped" not in out and "2 task(s) on 1 group(s)" in out, out
    # --durations as a fresh run's: the time in the call (where the ranks hung), not in a
    # setup that only waited for the verdict
    pattern = r"^([\d.]+)s (setup|call) +test_hang_then_next\.py::test_a_hang$"
    durations = {when: float(secs) for secs, when in re.findall(pattern, out, re.M)}
    assert durations["call"] >= 2.0 and durations.get("setup", 0.0) < 1.0, out
    times = dict(
        re.findall(r'<testcase classname="[^"]*" name="(\w+)" time="([\d.]+)"', junit.read_text())
    )
    assert float(times["test_a_hang"]) < 2 + 5, times  # the timeout, plus the stacks' wait
    assert float(times["test_next"]) < 1.5, times  # the same warm group: no ~6 s spawn


def test_a_thread_method_timeout_is_the_brokers_deadline(
    pytester: pytest.Pytester, private_broker: str
) -> None:
    """pytest-timeout's thread method ends a fresh rank's process (``os._exit``): a warm
    rank does not arm it; the broker's deadline ends the test, stops its group and the test
    fails with pytest-timeout's message (cpq.rank.timeouts)."""
    pytester.makepyfile(test_hang_then_next=NEXT)
    out = run(pytester, "--timeout", "2", "--timeout-method", "thread", "-k", "test_a_hang")
    assert "1 failed" in out and "Timeout (>2.0s) from pytest-timeout." in out, out
    assert "the group was stopped" in out, out


SPENT = """
import os
import time
import pytest

MARK = {mark!r}


@pytest.mark.timeout(2)
def test_times_out_then_runs_long():
    if not os.path.exists(MARK):
        open(MARK, "w").close()
        time.sleep(30)  # pytest-timeout ends this attempt
    time.sleep(3)  # past the timeout: the rerun runs untimed in a fresh run
"""


def test_a_rerun_after_a_timeout_runs_untimed_as_in_a_fresh_run(
    pytester: pytest.Pytester, shared: str, tmp_path: Path
) -> None:
    """pytest-timeout times the whole protocol and cancels its timer at the first failure,
    so rerunfailures' later attempts run untimed in a fresh run; a rank, where each attempt
    is a protocol of its own, armed the timer again (a newcomer's trial: passed fresh,
    failed under cpq)."""
    flags = ("-p", "no:flaky", "-p", "no:randomly", "--reruns", "1", "-rA")
    pytester.makepyfile(test_spent=SPENT.format(mark=str(tmp_path / "fresh")))
    fresh_out = run(pytester, "-p", "no:cpq", *flags)
    pytester.makepyfile(test_spent=SPENT.format(mark=str(tmp_path / "warm")))
    out = run(pytester, "--cpq-world-size", "1", *flags)
    assert "1 passed, 1 rerun" in fresh_out, fresh_out
    assert "1 passed, 1 rerun" in out, out


HANGING_FIXTURE = """
import time
import pytest


@pytest.fixture
def stuck():
    time.sleep(120)


@pytest.mark.cpq(world_size=1)
def test_setup_hangs(stuck):
    pass
"""


def test_a_fixture_that_hangs_is_still_ended_by_pytest_timeout(
    pytester: pytest.Pytester, shared: str
) -> None:
    """cpq takes pytest-timeout's timer for the body's deadline but keeps pytest-timeout's
    own timer running as a backstop: a setup that hangs ends, as in a fresh run."""
    pytester.makepyfile(test_setup_hangs=HANGING_FIXTURE)
    started = time.monotonic()
    out = run(pytester, "--timeout", "2", "-p", "no:randomly", timeout=120)
    assert "1 error" in out and "Timeout" in out, out
    assert time.monotonic() - started < 90  # the backstop, not the fixture's 120 s


SLOW_CONFTEST = """
import time

time.sleep(3)  # stands for a slow import (a plugin pulling in a big library)
"""

QUICK = """
import pytest


@pytest.mark.cpq(world_size=2)
def test_quick():
    pass
"""


def test_a_slow_session_build_is_not_the_first_tests_time(
    pytester: pytest.Pytester, private_broker: str
) -> None:
    """pytest-timeout times a test, not the conftests and plugins its session imports: a
    rank's session build (3 s here) is not charged to a 2 s timeout, as in a fresh run."""
    pytester.makeini("[pytest]\nmarkers =\n    cpq(world_size=2): runs on torchrun ranks\n")
    pytester.makeconftest(SLOW_CONFTEST)
    pytester.makepyfile(test_quick=QUICK)
    fresh = run(pytester, "-p", "no:cpq", "--timeout", "2")
    warm = run(pytester, "--timeout", "2")
    assert "1 passed" in fresh, fresh
    assert "1 passed" in warm, warm


def test_cpq_retries_0_runs_a_hang_once(
    pytester: pytest.Pytester, shared: str, tmp_path: Path
) -> None:
    count = tmp_path / "count"
    body = HANG.format(count=str(count), rank=RANK).replace(
        "world_size=2", 'world_size=2, timeout=2, env={"CPQ_TEST_POOL": "toolbox-hang"}'
    )
    pytester.makepyfile(test_hang=body)
    out = run(pytester, "--cpq-retries", "0")
    assert attempts(count) == 1, out
    assert "deadline of 2s passed" in out and "[CPQ-RETRY]" not in out, out


# --------------------------------------------------------------------------- --pdb

FAILS_ON_RANK_1 = """
import os
import pytest


@pytest.mark.cpq(world_size=2, env={"CPQ_TEST_POOL": "toolbox-pdb"})
def test_fails_on_rank_1():
    rank = RANK_EXPR
    some_local = 40 + rank
    print(f"rank {rank} was here")
    assert rank != 1


@pytest.mark.cpq(world_size=2, env={"CPQ_TEST_POOL": "toolbox-pdb"})
def test_after():
    pass
""".replace("RANK_EXPR", RANK)


def test_pdb_opens_the_post_mortem_in_the_failing_ranks_frame(
    pytester: pytest.Pytester, shared: str
) -> None:
    pytester.makepyfile(test_pdb=FAILS_ON_RANK_1)
    script = b"p some_local\np rank\nc\n"
    fresh = run(pytester, "-p", "no:cpq", "--pdb", stdin=script)
    out = run(pytester, "--pdb", stdin=script)
    for seen in (fresh, out):
        assert "1 failed, 1 passed" in seen, seen
        # The user's lines ran in the failing frame: its locals answer.
        assert re.search(r"\(Pdb[^)]*\) 41\n", seen), seen
        assert "assert rank != 1" in seen
        # What the test printed, before its traceback, as pytest shows it there.
        # (cpq's report of a marked test prefixes each rank's lines: "[rank 1] ...")
        section = seen.partition("> captured stdout >")[2].partition("> traceback >")[0]
        assert "rank 1 was here" in section, seen
    assert "entering PDB on rank 1 (relayed by cpq)" in out
    assert "(Pdb rank 1)" in out
    assert "pytest_report.py" not in out.partition("entering PDB")[2]  # not cpq's frame


def test_pdb_q_quits_the_session_like_pytest(pytester: pytest.Pytester, shared: str) -> None:
    pytester.makepyfile(test_pdb=FAILS_ON_RANK_1)
    fresh = run(pytester, "-p", "no:cpq", "--pdb", stdin=b"q\n")
    out = run(pytester, "--pdb", stdin=b"q\n")
    for seen in (fresh, out):
        assert "Quitting debugger" in seen and "test_after" not in seen.split("PDB")[-1], seen


BREAKPOINT = """
import pytest


@pytest.mark.cpq(world_size=2, env={"CPQ_TEST_POOL": "toolbox-pdb"})
def test_stops_here():
    x = 7
    breakpoint()
"""


def test_breakpoint_in_a_body_points_to_pdb_and_opens_there_with_it(
    pytester: pytest.Pytester, shared: str
) -> None:
    pytester.makepyfile(test_bp=BREAKPOINT)
    out = run(pytester)
    assert "1 failed" in out and "BreakpointInRank" in out, out
    assert "Run pytest with --pdb" in out
    out = run(pytester, "--pdb", stdin=b"p x\nc\n")
    assert re.search(r"\(Pdb rank 0\) 7\n", out), out  # in the frame that called breakpoint()


# --------------------------------------------------------------------------- reports

REPORTS = """
import os
import pytest


@pytest.mark.cpq(world_size=2)
def test_skips_in_the_body():
    print("hello from", RANK_EXPR)
    pytest.skip("not today")


@pytest.mark.cpq(world_size=2)
def test_prints():
    print("hello from", RANK_EXPR)


def helper(values):
    assert sum(values) == 4


@pytest.mark.cpq(world_size=2)
def test_fails_alike():
    values = [1, 2]
    helper(values)
""".replace("RANK_EXPR", 'os.environ.get("RANK")')


def failure_block(out: str, name: str) -> str:
    """The failure section of test ``name`` up to its location line, as pytest printed it."""
    match = re.search(rf"^_+ {name} _+\n(.*?^test_reports\.py:\d+: \w+)$", out, re.M | re.S)
    assert match is not None, out
    return match[1]


def skipped_line(out: str) -> str:
    match = re.search(r"^SKIPPED \[1\] (.*)$", out, re.M)
    assert match is not None, out
    return match[1]


def test_reports_read_like_a_fresh_runs(pytester: pytest.Pytester, shared: str) -> None:
    pytester.makepyfile(test_reports=REPORTS)
    # README's registration of the marker for runs without cpq (no unknown-mark warning).
    pytester.makeini("[pytest]\nmarkers =\n    cpq(world_size=2): runs on torchrun ranks\n")
    fresh = run(pytester, "-p", "no:cpq", "-rfs", "--strict-markers")
    junit = pytester.path / "junit.xml"
    out = run(pytester, "-rfs", f"--junitxml={junit}", "-o", "junit_logging=system-out")
    assert skipped_line(out) == skipped_line(fresh) == "test_reports.py:8: not today"
    # A failure reads as pytest printed it where it happened: the same > and E lines, the
    # same short summary line and JUnit message (the rank's exception, not cpq's words).
    block = failure_block(out, "test_fails_alike")
    assert block == failure_block(fresh, "test_fails_alike"), (block, fresh)
    assert ">       assert sum(values) == 4" in block and "E       assert 3 == 4" in block
    summary = "FAILED test_reports.py::test_fails_alike - assert 3 == 4"
    assert summary in out.splitlines() and summary in fresh.splitlines()
    assert 'message="assert 3 == 4' in junit.read_text()
    system_out = re.findall(r"<system-out>(.*?)</system-out>", junit.read_text(), re.S)
    assert any("[rank 0] hello from 0" in s and "[rank 1] hello from 1" in s for s in system_out)
    # Under one pytest-randomly seed both runs take the tests in the same order.
    seed = ("-p", "randomly", "--randomly-seed=3")
    quiet, fresh_quiet = run(pytester, "-qq", *seed), run(pytester, "-p", "no:cpq", "-qq", *seed)
    # pytest's own lines only (no cpq summary line), but the report's section naming the ranks
    extra = [line for line in quiet.splitlines() if line not in fresh_quiet.splitlines()]
    assert len(extra) == 2 and extra[0].strip("- ") == "cpq", extra
    assert extra[1].startswith("failed on rank(s) [0, 1] of 2 "), extra
    assert quiet.splitlines()[0] == fresh_quiet.splitlines()[0], (quiet, fresh_quiet)
