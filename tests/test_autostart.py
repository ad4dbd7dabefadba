"""Background brokers across upgrades: one running other cpq code is replaced at the next
session, but only when it was started to exit when idle and nothing uses it.

"Other code" is real here: a copy of this cpq package with one file changed, imported by a
real broker process through PYTHONPATH, as an old install would be.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT

from cpq import Client
from cpq.client.autostart import (
    broker_alive,
    code_fingerprint,
    ensure_broker,
    spawn_broker,
    stop_broker,
)

pytest_plugins = ["pytester"]


@pytest.fixture
def old_cpq(tmp_path: Path) -> Path:
    """A folder holding a copy of cpq with one file changed, as after an upgrade."""
    site = tmp_path / "old-site"
    shutil.copytree(ROOT / "cpq", site / "cpq", ignore=shutil.ignore_patterns("__pycache__"))
    init = site / "cpq" / "__init__.py"
    init.write_text(init.read_text() + "\n# the cpq of an older install\n")
    return site


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("CPQ_STATE_DIR", str(state))  # autostart's lock and logs go here
    yield state
    endpoint = f"ipc://{state / 'broker.sock'}"
    if broker_alive(endpoint):  # whichever broker serves the endpoint now
        with Client(endpoint, connect_timeout_s=5) as client:
            client.stop()


def start_old_broker(state: Path, old_cpq: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    endpoint = f"ipc://{state / 'broker.sock'}"
    env = dict(os.environ, CPQ_STATE_DIR=str(state), PYTHONPATH=str(old_cpq))
    process = spawn_broker(
        endpoint, ["--gpus", "none", *args], env=env, log_path=state / "old.log", cwd=old_cpq
    )
    with Client(endpoint, connect_timeout_s=10) as client:
        assert client.broker["code"] != code_fingerprint()  # it really runs the old copy
    return process, endpoint


def test_idle_background_broker_of_other_code_is_replaced(
    state: Path, old_cpq: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old, endpoint = start_old_broker(state, old_cpq, "--idle-exit", "600")
    with caplog.at_level(logging.WARNING, logger="cpq.client.autostart"):
        assert ensure_broker(endpoint) is True
    assert old.wait(timeout=30) == 0
    assert "replacing the idle background broker" in caplog.text
    with Client(endpoint, connect_timeout_s=10) as client:
        assert client.broker["code"] == code_fingerprint()
        assert client.broker["pid"] != old.pid
    assert ensure_broker(endpoint) is False  # this code's broker is kept


@pytest.mark.parametrize(
    ("args", "in_use", "why"),
    [
        (["--idle-exit", "600"], True, "in use"),
        ([], False, "not a background broker"),
    ],
    ids=["background-but-in-use", "started-by-hand"],
)
def test_broker_of_other_code_stays_when_someone_may_need_it(
    state: Path,
    old_cpq: Path,
    caplog: pytest.LogCaptureFixture,
    args: list[str],
    in_use: bool,
    why: str,
) -> None:
    old, endpoint = start_old_broker(state, old_cpq, *args)
    try:
        someone = Client(endpoint, name="someone-else") if in_use else contextlib.nullcontext()
        with someone, caplog.at_level(logging.WARNING, logger="cpq.client.autostart"):
            assert ensure_broker(endpoint) is False
        assert f"it is {why}, so it stays" in caplog.text
        assert old.poll() is None
    finally:
        stop_broker(old)


def test_session_header_says_the_broker_runs_other_code(
    pytester: pytest.Pytester, state: Path, old_cpq: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, endpoint = start_old_broker(state, old_cpq)  # started by hand: it stays
    try:
        monkeypatch.setenv("CPQ_ENDPOINT", endpoint)
        monkeypatch.setenv("PYTHONPATH", str(ROOT))
        pytester.makepyfile("def test_nothing():\n    pass\n")
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
        result.assert_outcomes(passed=1)
        # Same version number, edited source: the line says what differs, not "0.1 than 0.1".
        result.stdout.fnmatch_lines(
            ["cpq: that broker runs other cpq code * both, but its source files differ: code *"]
        )
    finally:
        stop_broker(old)


def test_a_broker_serves_the_moment_spawn_broker_returns(tmp_path: Path) -> None:
    """No window between "started" and "serving": the socket file exists and a status
    request is answered at once (the lock alone was taken before the bind, and a test that
    looked at the socket right away failed 2 times in 3)."""
    from conftest import start_broker

    for attempt in range(3):
        state = tmp_path / f"state{attempt}"
        process, endpoint = start_broker(state, "--max-ranks", "1", "--spares", "0")
        try:
            assert os.path.exists(endpoint[len("ipc://") :])  # bound, not merely locked
            with Client(endpoint, name="first", connect_timeout_s=2) as client:
                assert client.status()["broker"]["pid"] == process.pid
        finally:
            stop_broker(process)
