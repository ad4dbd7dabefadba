"""Sessions prepared ahead (cpq/caller/prepared.py): which modules they import, and the warm
caller's bookkeeping of the one ready and the callers waiting for it — on in-memory fakes
(a socket pair standing in for the prepared process). The end-to-end path is
tests/test_prepared_session.py."""

from __future__ import annotations

import os
import socket
import sys
import warnings
from pathlib import Path

import pytest

from cpq.caller import blame, prepared, wire


def _blame(blamed: dict[str, str], needs: dict[str, set[str]]) -> blame.Blame:
    record = blame.Blame()
    record.blamed = dict(blamed)
    record._needs = {k: set(v) for k, v in needs.items()}  # who imports whom, as a pass saw it
    return record


def test_only_modules_that_need_nothing_but_cuda_are_prepared() -> None:
    record = _blame(
        {"pkg.probe": "initialised CUDA", "pkg.training": "changed the root logger"},
        {
            "pkg.kernels": {"pkg.probe"},
            "pkg.attention": {"pkg.kernels"},
            "pkg.train_utils": {"pkg.training", "pkg.attention"},  # needs both
            "pkg.plain": {"pkg.other"},
        },
    )
    assert prepared.cuda_only(record) == ["pkg.probe", "pkg.attention", "pkg.kernels"]
    assert record.culprits()["pkg.train_utils"] == {"pkg.probe", "pkg.training"}
    assert "pkg.plain" not in record.culprits()


def test_a_module_blamed_for_cuda_and_more_is_not_prepared() -> None:
    record = _blame(
        {"pkg.probe": "initialised CUDA; changed the root logger"}, {"pkg.user": {"pkg.probe"}}
    )
    assert prepared.cuda_only(record) == []


def test_what_is_imported_follows_the_plan_and_skips_families_not_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(prepared.ENV, raising=False)
    left_out = wire.LeftOut(cuda_only=["json.probe", "json.kernels", "notloaded.x"])
    plan = ["os", "json.kernels", "notloaded.x", "json.probe"]
    assert "notloaded" not in sys.modules
    assert prepared.to_import(plan, left_out) == ["json.kernels", "json.probe"]
    monkeypatch.setenv(prepared.ENV, "0")
    assert prepared.to_import(plan, left_out) == []
    monkeypatch.delenv(prepared.ENV)
    left_out.no_prepared = "a session changed CUDA_VISIBLE_DEVICES"
    assert prepared.to_import(plan, left_out) == []


def test_the_left_out_file_keeps_what_may_be_prepared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CPQ_STATE_DIR", str(tmp_path))
    wire.folder().mkdir(parents=True, exist_ok=True)
    wire.add_left_out("k", {"a.probe": "initialised CUDA"}, {"a.user": "a.probe"}, ["a.probe"])
    wire.add_left_out("k", {"b.log": "changed the root logger"}, {}, ["a.probe", "a.user"])
    wire.no_prepared("k", "why not")
    left_out = wire.read_left_out("k")
    assert left_out.cuda_only == ["a.probe", "a.user"]
    assert left_out.no_prepared == "why not"
    assert set(left_out.blamed) == {"a.probe", "b.log"}
    wire.excluded_path("k").write_text('{"blamed": {}, "needing": {}, "passes": 0}')
    assert wire.read_left_out("k") == wire.LeftOut()  # a file of before: nothing prepared


#: A pid no process has (above Linux's pid_max): a fake prepared session "killed" is nobody.
NO_PID = 99_999_999


class _Prepared:
    """The prepared process's end of the socket pair, driven by the test."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def preparer(self) -> prepared.Preparer:
        preparer = prepared.Preparer(["pkg.probe"])
        preparer.started(NO_PID, self.ours)
        return preparer


def test_a_caller_waits_for_the_session_being_prepared_until_it_is_ready() -> None:
    fake = _Prepared()
    preparer = fake.preparer()
    assert not preparer.wanted(serving=True)  # one is being prepared
    caller, _ = socket.socketpair()
    assert preparer.park(caller, {"argv": ["pytest"]}, [])
    assert preparer.due() == []  # still preparing, and not waited for long
    wire.send(fake.theirs, {"ready": 1, "took_s": 0.1})
    preparer.heard()
    assert [each[0] for each in preparer.due()] == [caller]
    assert not preparer.park(caller, {}, [])  # ready: nobody waits


def test_a_caller_waits_no_longer_than_park_s() -> None:
    now = [100.0]
    preparer = prepared.Preparer(["pkg.probe"], clock=lambda: now[0])
    preparer.started(NO_PID, _Prepared().ours)
    caller, _ = socket.socketpair()
    preparer.park(caller, {}, [])
    now[0] += prepared.PARK_S - 0.1
    assert preparer.due() == []
    now[0] += 0.2
    assert len(preparer.due()) == 1
    # slower than a session's own imports would be: not prepared again by this warm caller
    assert preparer.why_not == f"not ready after {prepared.PARK_S:.0f} s"
    assert preparer.candidate is None


def test_an_unfit_prepared_session_is_dropped_for_good_and_its_callers_served() -> None:
    fake = _Prepared()
    preparer = fake.preparer()
    caller, _ = socket.socketpair()
    preparer.park(caller, {}, [])
    wire.send(fake.theirs, {"unfit": "pkg.probe changed the root logger"})
    preparer.heard()
    assert preparer.why_not == "pkg.probe changed the root logger"
    assert not preparer.wanted(serving=True)
    assert len(preparer.due()) == 1


def test_a_prepared_session_that_exits_is_not_prepared_again() -> None:
    preparer = _Prepared().preparer()
    assert not preparer.reaped(1, 0)
    assert preparer.reaped(NO_PID, 9)
    assert preparer.why_not == "it exited (wait status 9)"


def test_one_caller_waits_for_the_session_being_prepared_and_the_next_is_forked() -> None:
    preparer = _Prepared().preparer()
    first, _ = socket.socketpair()
    second, _ = socket.socketpair()
    assert preparer.park(first, {}, [])
    assert not preparer.park(second, {}, [])  # it would wait for nothing: served at once


def test_the_ready_session_takes_a_caller_or_refuses_it() -> None:
    fake = _Prepared()
    preparer = fake.preparer()
    wire.send(fake.theirs, {"ready": 1})
    preparer.heard()
    wire.send(fake.theirs, {"refused": "its imports read X, which differs"})
    assert preparer.take({"argv": ["pytest"]}, []) is None
    assert preparer.candidate is not None and preparer.candidate.ready  # still serves
    offered, _ = wire.recv(fake.theirs)
    assert offered is not None and offered["argv"] == ["pytest"]
    wire.send(fake.theirs, {"taken": True})
    assert preparer.take({"argv": ["pytest"]}, []) == NO_PID
    assert preparer.candidate is None and preparer.why_not == ""
    assert preparer.wanted(serving=True)  # the next one is prepared


def test_a_stale_prepared_session_is_dropped_and_the_next_one_prepared() -> None:
    """It refused a caller because a file it imported changed: it exits (stale for every
    caller), and the warm caller prepares a new one, which imports the edited file."""
    fake = _Prepared()
    preparer = fake.preparer()
    wire.send(fake.theirs, {"ready": 1})
    preparer.heard()
    wire.send(
        fake.theirs, {"refused": "/p/kernels.py changed since it was imported", "stale": True}
    )
    assert preparer.take({"argv": ["pytest"]}, []) is None
    assert preparer.candidate is None and preparer.why_not == ""
    assert preparer.wanted(serving=True)


def test_a_project_whose_session_stopped_preparing_gets_a_fork(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CPQ_STATE_DIR", str(tmp_path))
    wire.folder().mkdir(parents=True, exist_ok=True)
    fake = _Prepared()
    preparer = prepared.Preparer(["pkg.probe"], key="k")
    preparer.started(NO_PID, fake.ours)
    wire.send(fake.theirs, {"ready": 1})
    preparer.heard()
    wire.no_prepared("k", "the session changed CUDA_VISIBLE_DEVICES")
    assert preparer.take({"argv": ["pytest"]}, []) is None
    assert preparer.why_not == "the session changed CUDA_VISIBLE_DEVICES"
    assert not preparer.wanted(serving=True)


def test_what_the_prepared_imports_read_set_and_filtered_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process: a module that reads a variable, sets another, and adds a warning filter
    at import. The filter stays (the record's capture had undone it: a fresh process keeps
    it), the variable set is the session's from its start and binds nothing, and a caller
    is refused for a read or a set variable of another value."""
    (tmp_path / "prepmod_filters.py").write_text(
        "import os, warnings\n"
        "MODE = os.environ.get('PREPMOD_MODE')\n"
        "os.environ.setdefault('PREPMOD_CACHE', '/tmp/prepmod')\n"
        "warnings.filterwarnings('ignore', message='prepmod says')\n"
    )
    os.utime(tmp_path / "prepmod_filters.py", (1e9, 1e9))  # written long before it is imported
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PREPMOD_MODE", "fast")
    monkeypatch.delenv("PREPMOD_CACHE", raising=False)
    with warnings.catch_warnings():
        done = prepared.prepare(["prepmod_filters"])
        assert not isinstance(done, str), done
        assert any(f[1] is not None and f[1].pattern == "prepmod says" for f in warnings.filters)
    sys.modules.pop("prepmod_filters", None)
    # what imports read is recorded where the warm caller installed its watch on os.environ
    # (cpq.rank.importenv.install, its first act); here, as it would have recorded it:
    done.reads["PREPMOD_MODE"] = "fast"
    assert "PREPMOD_CACHE" not in done.reads
    assert done.kept.environ["PREPMOD_CACHE"] == "/tmp/prepmod"
    assert done.found == {"PREPMOD_CACHE": None}
    caller = {"environ": {"PREPMOD_MODE": "fast"}}
    assert prepared.refusal(done, caller) == prepared.Refusal()
    slow = prepared.refusal(done, {"environ": {"PREPMOD_MODE": "slow"}})
    assert "read PREPMOD_MODE" in slow.why and not slow.stale
    assert (
        "set PREPMOD_CACHE"
        in prepared.refusal(
            done, {"environ": {"PREPMOD_MODE": "fast", "PREPMOD_CACHE": "/elsewhere"}}
        ).why
    )


def test_a_prepared_record_the_session_cannot_read_fails_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the session checks comes with the record; one it cannot read is a failure, not
    a session that skips its check."""
    from cpq.client import handoff

    monkeypatch.setenv("CPQ_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(wire, "served", {"prepared": 342})
    with pytest.raises(pytest.UsageError, match="a record cpq cannot read"):
        handoff._check_prepared()
    monkeypatch.setattr(wire, "served", {"prepared": {"environ": dict(os.environ), "reads": {}}})
    handoff._check_prepared()  # nothing changed: the session goes on
