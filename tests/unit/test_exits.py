"""cpq.rank.exits: the atexit handlers a session's code registers in a rank run at its
boundary, last first; those of modules that stay go to the interpreter; the rest go."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cpq.rank import exits


@pytest.fixture
def forwarded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """What reaches the interpreter's own atexit (recorded, not registered)."""
    seen: list[Any] = []
    monkeypatch.setattr(exits, "_real_register", lambda f, *a, **k: seen.append((f, a, k)))
    monkeypatch.setattr(exits, "_real_unregister", lambda f: seen.append(("unregistered", f)))
    monkeypatch.setattr(exits, "pending", [])
    yield seen


def _register_from(module: str, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``atexit.register(func, ...)`` as code of ``module`` calls it."""
    namespace = {"__name__": module, "register": exits._register}
    namespace.update(func=func, args=args, kwargs=kwargs)
    exec("register(func, *args, **kwargs)", namespace)


def test_the_forgotten_modules_handlers_run_last_registered_first(forwarded: list[Any]) -> None:
    order: list[str] = []
    _register_from("conftest", order.append, "first")
    _register_from("test_things", order.append, "second")
    _register_from("conftest", lambda **k: order.append(k["word"]), word="third")
    assert exits.run_forgotten({"conftest", "test_things"}, set()) == 3
    assert order == ["third", "second", "first"]
    assert exits.pending == [] and forwarded == []
    assert exits.run_forgotten({"conftest"}, set()) == 0  # each runs once


def test_a_staying_modules_handler_goes_to_the_interpreter_and_a_dropped_ones_goes(
    forwarded: list[Any],
) -> None:
    ran: list[str] = []
    _register_from("multiprocessing.util", ran.append, "stays")
    _register_from("imported_ahead_never_used", ran.append, "dropped")
    _register_from("conftest", ran.append, "runs")
    assert exits.run_forgotten({"conftest"}, {"multiprocessing.util", "conftest"}) == 1
    assert ran == ["runs"]
    assert forwarded == [(ran.append, ("stays",), {})]


def test_a_failing_handler_is_printed_and_the_others_run(
    forwarded: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []

    def boom() -> None:
        raise KeyboardInterrupt

    _register_from("conftest", ran.append, "before")
    _register_from("conftest", boom)
    _register_from("conftest", ran.append, "after")
    assert exits.run_forgotten({"conftest"}, set()) == 3
    assert ran == ["after", "before"]
    err = capsys.readouterr().err
    assert "Exception ignored in atexit callback" in err and "KeyboardInterrupt" in err


def test_unregister_takes_a_handler_back(forwarded: list[Any]) -> None:
    ran: list[str] = []

    def handler() -> None:
        ran.append("ran")

    _register_from("conftest", handler)
    _register_from("conftest", handler)
    exits._unregister(handler)
    assert exits.run_forgotten({"conftest"}, set()) == 0 and ran == []
    assert forwarded == [("unregistered", handler)]


def test_a_handler_registered_as_a_decorator_is_returned(forwarded: list[Any]) -> None:
    def handler() -> None: ...

    assert exits._register(handler) is handler
    assert exits.pending[0].module == __name__


def test_a_test_module_pytest_dropped_runs_its_handlers_at_the_boundary(
    forwarded: list[Any],
) -> None:
    """A session's conftest and test modules leave ``sys.modules`` before the boundary (the
    rank imports them afresh next session): their handlers still run there."""
    ran: list[str] = []
    _register_from("conftest", ran.append, "conftest")
    exits.gone.add("conftest")
    assert exits.run_forgotten(set(), set()) == 1 and ran == ["conftest"]
    assert exits.gone == set()


def test_a_handler_without_a_module_counts_as_the_sessions(forwarded: list[Any]) -> None:
    ran: list[str] = []
    exits.pending.append(exits.Exit("", ran.append, ("nameless",)))
    assert exits.run_forgotten(set(), {"conftest"}) == 1 and ran == ["nameless"]


def test_a_handler_that_exits_or_closes_stderr_leaves_the_rank_and_the_others_running(
    forwarded: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank is not the process a handler meant to end: ``os._exit`` ends the handler;
    closed or replaced streams are the rank's again after the handlers."""
    import io
    import os
    import sys

    ran: list[str] = []
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    _register_from("conftest", ran.append, "first registered, last run")
    _register_from("conftest", os._exit, 3)
    _register_from("conftest", lambda: os._exit(4))
    _register_from("conftest", lambda: sys.stderr.close())
    _register_from("conftest", lambda: _register_from("conftest", ran.append, "late"))
    assert exits.run_forgotten({"conftest"}, set()) == 5
    assert ran == ["first registered, last run"]  # not "late": registered while exiting
    assert err.closed and not sys.stderr.closed and exits.pending == []
    assert os._exit is exits._real_exit


def test_a_registration_that_is_not_callable_is_refused(forwarded: list[Any]) -> None:
    with pytest.raises(TypeError):
        exits._register(42)  # type: ignore[arg-type]
