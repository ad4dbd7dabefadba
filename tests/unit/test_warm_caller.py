"""The warm caller's pure parts: what a session plans, the messages and the plan file, the
checks before a fork (cpq.caller, cpq.client.handoff). The processes themselves:
tests/test_warm_caller.py."""

from __future__ import annotations

import importlib.machinery
import os
import socket
import sys
import types
from pathlib import Path

import msgpack
import pytest

from cpq.caller import fit, wire
from cpq.client import handoff


def _module(name: str, loader: object | None, file: str | None = None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = None if loader is None else importlib.machinery.ModuleSpec(name, loader)
    if file is not None:
        module.__file__ = file
    return module


class AssertionRewritingHook:  # the name is what pytest's hook is known by
    pass


def test_a_plan_keeps_import_order_and_leaves_out_what_pytest_imports_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = importlib.machinery.SourceFileLoader("x", "/x.py")
    fakes = {
        "zz_lib": _module("zz_lib", source, "/site/zz_lib/__init__.py"),
        "zz_lib._native": _module("zz_lib._native", None),  # made by its package: no spec
        "zz_lib.core": _module("zz_lib.core", source, "/site/zz_lib/core.py"),
        "zz_suite": _module("zz_suite", source, "/p/zz_suite/__init__.py"),
        "zz_suite.test_one": _module("zz_suite.test_one", source, "/p/zz_suite/test_one.py"),
        "zz_helpers": _module("zz_helpers", AssertionRewritingHook(), "/p/zz_helpers.py"),
        "zz_conf": _module("zz_conf", source, "/p/conftest.py"),
        "zz_app": _module("zz_app", source, "/p/zz_app.py"),
    }
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)
    planned = [m for m in handoff.modules_to_plan(["test_*.py"]) if m.startswith("zz_")]
    assert planned == ["zz_lib", "zz_lib.core", "zz_app"]
    everything = handoff.modules_to_plan(["test_*.py"])
    assert "json" not in everything and "pytest" not in everything and "cpq" not in everything


def test_a_plan_file_round_trips_and_a_bad_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("CPQ_STATE_DIR", str(state))
    plan = wire.Plan("k1", ["a", "a.b"], ["/p"], "/p", {"X": "1"}, ["/usr/bin/python3"], 6.5)
    written = plan.write()
    assert oct(written.stat().st_mode & 0o777) == "0o600"
    assert wire.Plan.read(written) == plan
    written.write_text('{"v": 99}')
    with pytest.raises(wire.WireError, match="plan version 99"):
        wire.Plan.read(written)
    written.write_text(
        '{"v": 1, "key": "k", "modules": [1], "path": [], "cwd": "/", '
        '"environ": {}, "interpreter": [], "start_s": 1.0}'
    )
    with pytest.raises(wire.WireError, match="lists of text"):
        wire.Plan.read(written)
    written.write_text("not json")
    with pytest.raises(wire.WireError, match="unreadable plan"):
        wire.Plan.read(written)


def test_what_is_left_out_round_trips_and_bounds_the_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass finds every module to leave out, unless a dependency went unseen; passes that
    find the same modules again must not restart the warm caller for ever."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("CPQ_STATE_DIR", str(state))
    assert wire.read_left_out("k1") == wire.LeftOut() and not wire.gave_up("k1")
    left_out = wire.LeftOut({"setuptools": "changed sys.path"}, {"distutils.compat": "setuptools"})
    for passes in range(1, wire.MAX_PASSES + 1):
        left_out.passes = passes
        wire.write_left_out("k1", left_out)
        assert wire.read_left_out("k1") == left_out
        assert "distutils.compat" in left_out and "setuptools" in left_out
        assert "setuptools.command.build" in left_out  # its package's import is left out
        assert "distutils" not in left_out and "setuptoolsx" not in left_out
        assert wire.gave_up("k1") == (passes == wire.MAX_PASSES)
    # two warm callers of one project warming at once: neither loses the other's findings
    wire.add_left_out("k4", {"a": "changed sys.path"}, {"a_user": "a"})
    merged = wire.add_left_out("k4", {"b": "started a thread"}, {"b_user": "b", "a": "b"})
    assert merged == wire.read_left_out("k4")
    assert merged.blamed == {"a": "changed sys.path", "b": "started a thread"}
    assert merged.needing == {"a_user": "a", "b_user": "b"} and merged.passes == 2
    wire.write_left_out("k2", wire.LeftOut({"*": "refused"}, passes=1))
    assert wire.gave_up("k2")
    wire.excluded_path("k3").write_text('{"blamed": []}')
    assert wire.read_left_out("k3") == wire.LeftOut()


@pytest.mark.parametrize(
    ("ready_in", "start_s", "waits_s"),
    [
        (3.0, 16.0, 3.0 + 3.2),  # ready before the session would have started: wait, slack
        (15.0, 16.0, 16.0),  # never longer than a start of its own
        (20.0, 16.0, 0.0),  # a start of its own is sooner: do not wait
        (1.0, 4.0, 3.0),  # slack of at least 2 s
        (-60.0, 16.0, -56.8),  # long overdue (its process died): the deadline has passed
        (3.0, 0.0, 0.0),  # no start measured
    ],
)
def test_a_session_waits_for_a_warming_warm_caller_only_when_that_is_sooner(
    ready_in: float, start_s: float, waits_s: float
) -> None:
    now = 1000.0
    until = wire.wait_until({"pid": 1, "ready_by": now + ready_in}, start_s, now)
    assert until == (pytest.approx(now + waits_s) if waits_s else 0.0)
    assert wire.wait_until({}, start_s, now) == 0.0


def test_messages_carry_descriptors_and_junk_is_refused_with_its_descriptors_closed() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read_end, write_end = os.pipe()
    try:
        wire.send(left, {"argv": ["pytest"]}, [write_end])
        message, fds = wire.recv(right, maxfds=3)
        assert message == {"v": wire.VERSION, "argv": ["pytest"]}
        assert len(fds) == 1
        os.write(fds[0], b"through")  # the same pipe, another descriptor
        os.close(fds[0])
        assert os.read(read_end, 7) == b"through"

        socket.send_fds(left, [msgpack.packb({"v": 0})], [write_end])
        with pytest.raises(wire.WireError, match="not a version-1 message"):
            wire.recv(right, maxfds=3)
        left.sendall(b"\xc1")  # never valid msgpack
        with pytest.raises(wire.WireError, match="undecodable"):
            wire.recv(right)
        left.close()
        assert wire.recv(right) == (None, [])
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        right.close()


@pytest.mark.parametrize(
    "orig, expected",
    [
        (["python3", "-m", "pytest", "-q"], []),
        (
            ["python3", "-X", "importtime", "-W", "error", "-B", "-m", "pytest"],
            ["-X", "importtime", "-W", "error", "-B"],
        ),
        (["/venv/bin/python", "-sE", "/venv/bin/pytest", "-x"], ["-sE"]),
    ],
)
def test_the_warm_caller_starts_with_the_callers_interpreter_options(
    monkeypatch: pytest.MonkeyPatch, orig: list[str], expected: list[str]
) -> None:
    monkeypatch.setattr(sys, "orig_argv", orig)
    assert handoff._interpreter() == [sys.executable, *expected]


@pytest.mark.parametrize(
    "value, mode", [("", "auto"), ("auto", "auto"), ("0", "off"), ("off", "off"), ("1", "on")]
)
def test_the_variable_says_when(monkeypatch: pytest.MonkeyPatch, value: str, mode: str) -> None:
    monkeypatch.setenv(wire.ENABLE_VAR, value)
    assert handoff.mode() == mode


def test_a_request_of_another_shape_is_refused_before_anything_forks() -> None:
    good = {
        "argv": ["pytest"],
        "path": ["/p"],
        "cwd": "/p",
        "umask": 0o22,
        "environ": {"A": "1"},
        "streams": [None, {}, {}],
    }
    fit.check_shape(good)
    for field, bad in [("argv", "pytest"), ("cwd", 3), ("environ", {"A": 1}), ("streams", [])]:
        with pytest.raises(fit.Refused):
            fit.check_shape({**good, field: bad})


def test_a_variable_the_imports_read_must_be_the_callers() -> None:
    reads = {"HEAVY_MODE": "a", "UNSET_ONE": None}
    read = "its imports read {}, which differs for this session".format
    assert fit.misfit({"HEAVY_MODE": "a"}, reads, {}) == ""
    assert fit.misfit({"HEAVY_MODE": "b"}, reads, {}) == read("HEAVY_MODE")
    assert fit.misfit({"HEAVY_MODE": "a", "UNSET_ONE": ""}, reads, {}) == read("UNSET_ONE")
    # a variable the imports set: the caller's value must be the one they found (unset)
    found = {"CACHE_DIR": None}
    assert fit.misfit({"HEAVY_MODE": "a"}, reads, found) == ""
    assert fit.misfit({"HEAVY_MODE": "a", "CACHE_DIR": "/x"}, reads, found) == (
        "its imports set CACHE_DIR, which this session has otherwise"
    )
