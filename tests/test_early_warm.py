"""A session asks for the last session's group before its conftests import (cpq.client.early_warm).

The broker here is a real one that the plugin autostarts in a private state directory, as
on a developer's machine after the background broker idled out; the project's conftest
stands in for one that imports the world (Megatron-LM's imports torch and ``megatron.core``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from cpq import Client
from cpq.client.autostart import broker_alive

pytest_plugins = ["pytester"]

#: The conftest: with CPQ_TEST_WAIT_FOR_GROUP set, its import ends only once the broker
#: shows a group of world size 1 (asked for before this import could have sent anything).
CONFTEST = """
import os, time

if os.environ.get("CPQ_TEST_WAIT_FOR_GROUP"):
    from cpq import Client
    from cpq.paths import default_endpoint

    deadline = time.monotonic() + 90
    while True:
        with Client(default_endpoint(), connect_timeout_s=10) as client:
            pools = client.status()["pools"]
        if any(p["world_size"] == 1 for p in pools):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("no group was asked for while the conftest imported")
        time.sleep(0.05)  # polling the broker's state, not waiting for it to happen
"""

TESTS = """
import torch.distributed as dist

def test_rank():
    assert dist.get_world_size() == 1

def test_again():
    assert dist.get_rank() == 0
"""


@pytest.fixture
def cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A private state directory with no broker running: the plugin autostarts one."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("CPQ_STATE_DIR", str(state))
    monkeypatch.delenv("CPQ_ENDPOINT", raising=False)
    monkeypatch.delenv("CPQ_AUTOSTART", raising=False)
    endpoint = f"ipc://{state / 'broker.sock'}"
    yield endpoint
    stop(endpoint)


def stop(endpoint: str) -> None:
    """Stop the broker and wait for its exit (its lock is released when the process ends)."""
    if not broker_alive(endpoint):
        return
    with Client(endpoint, connect_timeout_s=5) as client:
        pid = client.broker["pid"]
        client.stop()
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pid).wait(timeout=30)
    assert not broker_alive(endpoint)


def test_a_cold_session_asks_for_the_last_sessions_group_before_its_conftest(
    pytester: pytest.Pytester, cold: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_ranks=TESTS)
    pytester.makeini("[pytest]\n")
    first = pytester.runpytest_subprocess("--cpq-world-size", "1")
    first.assert_outcomes(passed=2)  # and the cache now says what the session needed
    stop(cold)  # the background broker idled out

    monkeypatch.setenv("CPQ_TEST_WAIT_FOR_GROUP", "1")
    second = pytester.runpytest_subprocess("--cpq-world-size", "1")
    second.assert_outcomes(passed=2)
    assert "no group was asked for" not in second.stdout.str()


def test_without_a_cache_nothing_is_asked_for_early(pytester: pytest.Pytester, cold: str) -> None:
    """The early request is the cache's: a first session sends none, and its tests run
    as before (the group starts when the session opens)."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_ranks=TESTS)
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--cpq-world-size", "1")
    result.assert_outcomes(passed=2)
    assert not (pytester.path / ".pytest_cache").exists()


def test_pytest_help_starts_no_broker(pytester: pytest.Pytester, cold: str) -> None:
    """A cache that names a group is no reason to start a broker for a command that runs no
    test."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_ranks=TESTS)
    pytester.makeini("[pytest]\n")
    pytester.runpytest_subprocess("--cpq-world-size", "1").assert_outcomes(passed=2)
    stop(cold)
    for command in (["--help"], ["--fixtures"], ["--collect-only", "--cpq-world-size", "1"]):
        assert pytester.runpytest_subprocess(*command).ret == 0
        assert not broker_alive(cold), command
