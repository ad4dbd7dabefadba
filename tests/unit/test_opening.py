"""When the calling process opens its session on the ranks ahead, and which test waits for
the opening (cpq.client.opening), on fakes of pytest's config and cpq's session. The real
path (a broker, ranks, a fresh torchrun to compare with) is tests/test_opening.py."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from cpq.client import opening
from cpq.protocol import TaskResult


class FakeConfig:
    def __init__(self, collectonly: bool = False, xdist_controller: bool = False) -> None:
        self.option = SimpleNamespace(collectonly=collectonly)
        self.stash = pytest.Stash()
        self.pluginmanager = SimpleNamespace(
            has_plugin=lambda name: xdist_controller and name == "dsession"
        )

    def getoption(self, name: str, default: Any = None) -> Any:
        return "fd" if name == "capture" else default


class FakeSession:
    def __init__(self, world_size: int | None = 2, **kwargs: Any) -> None:
        self.world_size = world_size
        self.under_launcher = kwargs.get("under_launcher", False)
        self.broker_gone = kwargs.get("broker_gone", "")
        self.at_hand = kwargs.get("at_hand", True)
        self.waited: list[str] = []

    def broker_at_hand(self) -> bool:
        return self.at_hand

    def wait(self, future: Future[TaskResult], test_id: str) -> TaskResult:
        self.waited.append(test_id)
        return future.result()


@pytest.mark.parametrize(
    ("config", "session", "expected"),
    [
        (FakeConfig(), FakeSession(2), True),
        (FakeConfig(), FakeSession(None), False),  # marker tests only: sizes unknown yet
        (FakeConfig(), FakeSession(2, under_launcher=True), False),
        (FakeConfig(), FakeSession(2, broker_gone="cpq: gone"), False),
        (FakeConfig(collectonly=True), FakeSession(2), False),
        (FakeConfig(xdist_controller=True), FakeSession(2), False),  # its workers open
        (FakeConfig(), FakeSession(2, at_hand=False), False),  # autostart off, none runs
    ],
)
def test_who_opens_ahead(config: FakeConfig, session: FakeSession, expected: bool) -> None:
    assert opening.wanted(config, session) is expected  # type: ignore[arg-type]


def _opened(config: FakeConfig, outcome: str = "passed", error: bool = False) -> None:
    future: Future[TaskResult] = Future()
    if error:
        future.set_exception(ConnectionError("broker gone"))
    else:
        future.set_result(TaskResult(task_id="t", outcome=outcome))  # type: ignore[arg-type]
    config.stash[opening._KEY] = opening.Opening("key", "cpq-opening:key", future, None)


def test_the_first_test_of_the_sessions_spec_waits_once_and_asks_for_the_group() -> None:
    config, session = FakeConfig(), FakeSession(2)
    _opened(config)
    args: tuple[Any, ...] = (config, session, "key")
    assert opening.wait(*args, "t.py::marker", 4, None) == ""  # another world size
    assert opening.wait(*args, "t.py::env", 2, {"A": "1"}) == ""  # a marker's own env
    assert session.waited == []  # the opening is left for a test of its spec
    assert opening.wait(*args, "t.py::first", 2, None) == "cpq-opening:key"
    assert session.waited == ["t.py::first"]
    assert opening.wait(*args, "t.py::second", 2, None) == ""  # once
    assert session.waited == ["t.py::first"]


@pytest.mark.parametrize(
    ("key", "outcome", "error"),
    [
        ("other", "passed", False),  # the session changed after it started: not this one
        ("key", "failed", False),  # the rank could not build it: the test builds it itself
        ("key", "passed", True),  # the broker went away: the test's own submit says so
    ],
)
def test_an_opening_that_cannot_serve_the_test_is_dropped(
    key: str, outcome: str, error: bool
) -> None:
    config, session = FakeConfig(), FakeSession(2)
    _opened(config, outcome, error)
    assert opening.wait(config, session, key, "t.py::first", 2, None) == ""  # type: ignore[arg-type]
    assert config.stash[opening._KEY] is None


def test_the_openings_wait_for_a_group_is_the_sessions_in_its_summary() -> None:
    """A newcomer's trial read "waiting for a ws2/auto group: 1 starting" during a cold
    session, then "0.0s waiting for groups to start" in its summary: the opening waited."""
    from concurrent.futures import Future

    from cpq.client.session import CpqSession, Stats
    from cpq.records import TaskResult

    class Client:
        def wait(self, future: Future[TaskResult], say: object) -> TaskResult:
            return future.result()

    session = object.__new__(CpqSession)
    session.config, session._client, session.stats = None, Client(), Stats()  # type: ignore[assignment]
    future: Future[TaskResult] = Future()
    future.set_result(TaskResult("t1", "passed", group_id="g1", groups=["g1"], spawn_wait_s=2.5))
    session.wait(future, "t.py::first")
    assert session.stats.spawn_wait_s == 2.5 and session.stats.groups == {"g1"}
    assert session.stats.tasks == 0  # the tests' tasks only: it ran none
