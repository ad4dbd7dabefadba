"""The timeline of a real session: a private broker, a real pytest session with two xdist
workers, real torchrun groups; then ``cpq-status --trace`` checked against the trace-event
format, and ``cpq-status --timeline`` opened in a real headless Chromium (Debian's
``chromium``), checked by what it shows. The screenshot is kept under the CI artifact folder
(``CPQ_TEST_ARTIFACTS``, default ``.ci/artifacts/``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import ROOT, start_broker, stop_broker
from unit.traces import check_trace, thread_names

from cpq import Client
from cpq.timeline import records

pytest_plugins = ["pytester"]

SUITE = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.cpq(world_size=1)
@pytest.mark.parametrize("n", range(5))
def test_sum(n):
    t = torch.tensor([float(n)])
    dist.all_reduce(t)
    assert t.item() == n


@pytest.mark.cpq(world_size=1)
def test_fails():
    assert dist.get_rank() == 1, "rank zero disagrees"


@pytest.mark.cpq(world_size=1)
def test_skips():
    pytest.skip("not here")
"""
TESTS = {f"test_tl.py::test_sum[{n}]": "passed" for n in range(5)} | {
    "test_tl.py::test_fails": "failed",
    "test_tl.py::test_skips": "skipped",
}


def cpq_status(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "cpq-status"
    return subprocess.run(
        [str(script), *args],
        env=dict(os.environ, CPQ_STATE_DIR=str(state)),
        capture_output=True,
        text=True,
        timeout=60,
    )


def artifacts() -> Path:
    where = Path(os.environ.get("CPQ_TEST_ARTIFACTS", ROOT / ".ci" / "artifacts"))
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pytest session of 7 tests on two xdist workers against a fresh private broker; its
    state directory (the broker is stopped, so every event is written)."""
    state = tmp_path_factory.mktemp("tl-state")
    suite = tmp_path_factory.mktemp("tl-suite")
    (suite / "test_tl.py").write_text(SUITE)
    process, endpoint = start_broker(state, "--max-ranks", "2", "--spares", "0")
    try:
        env = dict(os.environ, CPQ_ENDPOINT=endpoint, CPQ_STATE_DIR=str(state))
        env["PYTHONPATH"] = os.pathsep.join([str(suite), str(ROOT)])
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q", "-rA"],
            cwd=suite,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert "5 passed" in result.stdout and "1 failed" in result.stdout, result.stdout
    finally:
        stop_broker(process)
    return state


def test_the_trace_of_a_real_session_has_every_test_once_and_every_spawn(
    session: Path, tmp_path: Path
) -> None:
    out = tmp_path / "trace.json"
    done = cpq_status("--trace", str(out), state=session)
    assert done.returncode == 0, done.stderr
    assert "ui.perfetto.dev" in done.stdout
    trace = json.loads(out.read_text())
    slices = check_trace(trace)
    names = thread_names(trace)
    groups = {track: name for track, name in names.items() if not name.startswith("waits")}
    assert len(groups) == 2
    assert all(re.match(r"g\d+-[0-9a-z]+ ws1/\w+ · CPU$", n) for n in groups.values()), groups
    for track in groups:
        assert slices[track][0]["cat"] == "spawn" and slices[track][0]["dur"] > 0
        # The first task on each fresh group is its warm-up (a group ready last may get none:
        # the other one may have cleared the queue).
        assert [e["cat"] for e in slices[track][1:2]] in ([], ["warm-up"])
    ran = [e for track in groups for e in slices[track] if e["cat"] in ("task", "warm-up")]
    assert sorted(e["name"] for e in ran) == sorted(TESTS)  # each test once
    for event in ran:
        assert event["args"]["outcome"] == TESTS[event["name"]]
        assert event["args"]["attempt"] == 1 and event["args"]["queue_wait_s"] >= 0
    waits = [e for t, s in slices.items() if t not in groups for e in s]
    assert sorted(e["name"] for e in waits) == sorted(TESTS)
    clients = {names[t] for t in slices if t not in groups}
    assert {re.sub(r" \(pid \d+\)", "", c) for c in clients} == {
        "waits · pytest gw0",
        "waits · pytest gw1",
    }


class _Visible(HTMLParser):
    """The text and the slices' test ids of a DOM as Chromium dumped it."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.tests: list[str] = []
        self.groups: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "rect" and found.get("data-test"):
            self.tests.append(str(found["data-test"]))
        if tag == "g" and found.get("data-group"):
            self.groups.append(str(found["data-group"]))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("no chromium on PATH: install Debian's chromium package (.ci/run does)")
    return found


def headless(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    flags += [f"--user-data-dir={cwd / 'profile'}", "--disable-dev-shm-usage"]
    return subprocess.run(
        [chromium(), *flags, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_the_page_in_a_real_browser_shows_each_group_and_each_test(
    session: Path, tmp_path: Path
) -> None:
    page = tmp_path / "timeline.html"
    done = cpq_status("--timeline", str(page), state=session)
    assert done.returncode == 0, done.stderr
    dom = headless("--dump-dom", page.as_uri(), cwd=tmp_path)
    assert dom.returncode == 0 and "<svg" in dom.stdout, dom.stderr[-2000:]
    seen = _Visible()
    seen.feed(dom.stdout)
    text = " ".join(seen.text)
    assert len(seen.groups) == 2
    for group in seen.groups:
        assert re.search(rf"\b{group} ws1/\w+ · CPU", text), group
    assert sorted(seen.tests) == sorted(TESTS)
    for test in TESTS:  # the task table lists each one by name
        assert test in text
    assert "Groups that sat idle" in text and "Seconds spent spawning" in text
    shot = artifacts() / "timeline-real-session.png"
    taken = headless(f"--screenshot={shot}", "--window-size=1500,900", page.as_uri(), cwd=tmp_path)
    assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]


def test_a_time_ago_reads_as_the_readme_writes_it(session: Path, tmp_path: Path) -> None:
    """``cpq status --timeline x.html --since -4m``: a value that starts with ``-`` after
    ``--since``/``--until`` is the time, not an option (argparse alone says "expected one
    argument")."""
    page = tmp_path / "x.html"
    command = [str(Path(sys.executable).parent / "cpq"), "status", "--timeline", str(page)]
    done = subprocess.run(
        [*command, "--since", "-1d"],
        env=dict(os.environ, CPQ_STATE_DIR=str(session)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and page.stat().st_size > 0, done.stderr
    trace = tmp_path / "trace.json"
    done = cpq_status("--trace", str(trace), "--since", "-1d", "--until", "-0s", state=session)
    assert done.returncode == 0, done.stderr
    assert sorted(check_trace(json.loads(trace.read_text()))) != []


def test_no_session_and_a_bad_time_are_clear_errors(session: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    done = cpq_status("--trace", str(out), "--session", "no-such-session", state=session)
    assert done.returncode == 4 and "no-such-session" in done.stderr and not out.exists()
    done = cpq_status("--trace", str(out), "--since", "yesterday", state=session)
    assert done.returncode == 4 and "cannot read the time" in done.stderr and not out.exists()
    empty = tmp_path / "empty-state"
    empty.mkdir(mode=0o700)
    done = cpq_status("--timeline", str(out), state=empty)
    assert done.returncode == 4 and "no timeline history" in done.stderr


def test_a_sigkilled_brokers_group_is_not_shown_in_the_next_brokers_session(
    tmp_path: Path,
) -> None:
    """A broker is killed with SIGKILL after a task; a new one starts on the same state
    directory and runs the next session. That session's page lists only the new broker's
    group (the killed one's is not an idle group of it), whose id is not the old one's; the
    whole history shows the old group ended with its broker."""
    state = tmp_path / "state"
    pool = {"env": {"CPQ_TEST_POOL": "timeline-kill"}, "roots": [str(ROOT)]}
    args = ("--gpus", "none", "--max-ranks", "1", "--spares", "0")
    killed, endpoint = start_broker(state, *args)
    second = None
    try:
        with Client(endpoint, name="pytest", info={"session": "s-killed"}) as client:
            old = client.submit("workers.collectives:noop", 1, **pool)  # type: ignore[arg-type]
        assert old.outcome == "passed", old.message
        history = records.timeline_path(state / "timings.jsonl")
        deadline = time.monotonic() + 10  # the broker writes its events once per tick
        while not any(r["ev"] == "task" for r in records.read(history).records):
            assert time.monotonic() < deadline, "the task's record was never written"
            time.sleep(0.05)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=10)
        second, again = start_broker(state, *args)
        assert again == endpoint
        with Client(endpoint, name="pytest", info={"session": "s-after"}) as client:
            new = client.submit("workers.collectives:noop", 1, **pool)  # type: ignore[arg-type]
        assert new.outcome == "passed", new.message
    finally:
        if killed.poll() is None:
            killed.kill()
        if second is not None:
            stop_broker(second)
    assert new.group_id != old.group_id  # ids are not reused across brokers
    page = tmp_path / "session.html"
    done = cpq_status("--timeline", str(page), state=state)  # the last session: s-after
    assert done.returncode == 0, done.stderr
    seen = _Visible()
    seen.feed(page.read_text())
    text = " ".join(seen.text)
    assert seen.groups == [new.group_id] and old.group_id not in text  # nor as an idle one
    whole = tmp_path / "all.html"
    done = cpq_status("--timeline", str(whole), "--session", "all", state=state)
    assert done.returncode == 0, done.stderr
    seen = _Visible()
    seen.feed(whole.read_text())
    assert sorted(seen.groups) == sorted([old.group_id, new.group_id])
    rows = " ".join(seen.text).split("Groups: busy share")[1].split("Seconds spent spawning")[0]
    assert re.search(rf"{re.escape(old.group_id)} .*?broker-gone", rows), rows
