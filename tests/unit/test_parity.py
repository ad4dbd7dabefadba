"""Parity with a fresh run, pure logic: import-time variables (``cpq.rank.importenv``), the
caller's random state (``cpq.rng``), groups of one session, coverage relay fields."""

from __future__ import annotations

import importlib
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest

from cpq import protocol, rng
from cpq.broker import notices
from cpq.rank import importenv

from .fakes import Sim, spec

FEATURES = sorted(protocol.ALL_FEATURES)


@pytest.fixture
def tracked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    importenv.install()
    try:
        yield tmp_path
    finally:
        importenv.uninstall()


def _import(folder: Path, name: str, source: str) -> object:
    (folder / f"{name}.py").write_text(source)
    importlib.invalidate_caches()
    try:
        return importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)


def test_a_read_during_an_import_binds_and_a_read_at_call_time_does_not(
    tracked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TPL_T_MODE", raising=False)
    monkeypatch.setenv("TPL_T_LEVEL", "3")
    importenv.start_done()
    _import(tracked, "cpq_t_lib", "import os\nMODE = os.environ.get('TPL_T_MODE')\n")
    _import(tracked, "cpq_t_lib2", "import os\nLEVEL = os.getenv('TPL_T_LEVEL')\n")
    os.environ.get("TPL_T_CALL")  # not importing: per task, binds nothing
    assert importenv.bound == {"TPL_T_MODE": None, "TPL_T_LEVEL": "3"}
    assert importenv.differs() == ("", False)
    monkeypatch.setenv("TPL_T_MODE", "fast")  # absent when imported: now a difference
    assert importenv.differs() == ("TPL_T_MODE", False)
    monkeypatch.delenv("TPL_T_MODE")
    monkeypatch.setenv("TPL_T_LEVEL", "4")
    assert importenv.differs() == ("TPL_T_LEVEL", False)


def test_a_path_list_that_differs_by_cpqs_routing_folder_alone_binds_the_same(
    tracked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--cpq-torchrun`` puts its routing folder (only cpq's ``torchrun`` shim) in front of
    ``PATH``: a launch with it is the same search as the group's start, not a new group."""
    monkeypatch.setenv("TPL_T_PATH", "/usr/bin:/bin")
    importenv.start_done()
    _import(tracked, "cpq_t_paths", "import os\nWHERE = os.environ.get('TPL_T_PATH')\n")
    monkeypatch.setenv("TPL_T_PATH", "/state/torchrun-route-1a2b:/usr/bin:/bin")
    assert importenv.differs() == ("", False)
    monkeypatch.setenv("TPL_T_PATH", "/opt/other/bin:/usr/bin:/bin")  # another search
    assert importenv.differs() == ("TPL_T_PATH", False)


def test_the_harness_variables_bind_nothing(tracked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library that copies the whole environment at import reads PYTEST_CURRENT_TEST,
    which changes with every test: binding it would cost a fresh group per test."""
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "test_a.py::test_one (call)")
    monkeypatch.setenv("TPL_T_COPIED", "1")
    importenv.start_done()
    _import(tracked, "tpl_t_copy", "import os\nSNAPSHOT = dict(os.environ)\n")
    assert "TPL_T_COPIED" in importenv.bound and "PYTEST_CURRENT_TEST" not in importenv.bound
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "test_a.py::test_two (call)")
    assert importenv.differs() == ("", False)


def test_the_shells_bookkeeping_read_by_a_walk_binds_nothing(
    tracked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tqdm (imported by torch) walks the whole environment at import for its ``TQDM_``
    variables: a ``cd`` (``OLDPWD``) or a script around the command (``SHLVL``) must not
    make the imports stale. Read by name, such a variable binds as any other."""
    monkeypatch.setenv("OLDPWD", "/here")
    monkeypatch.setenv("SHLVL", "1")
    monkeypatch.setenv("TPL_T_WALKED", "1")
    importenv.start_done()
    _import(tracked, "tpl_t_walk", "import os\nFOUND = {k: v for k, v in os.environ.items()}\n")
    assert "TPL_T_WALKED" in importenv.bound
    assert "OLDPWD" not in importenv.bound and "SHLVL" not in importenv.bound
    monkeypatch.setenv("OLDPWD", "/elsewhere")
    monkeypatch.setenv("SHLVL", "2")
    assert importenv.differs() == ("", False)
    _import(tracked, "tpl_t_named", "import os\nBEFORE = os.environ.get('OLDPWD')\n")
    assert importenv.bound["OLDPWD"] == "/elsewhere"


def test_a_walk_that_tests_each_name_for_a_prefix_binds_only_those_variables(
    tracked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tqdm's ``envwrap`` walks the environment for its ``TQDM_`` variables: only those bind
    (another variable of the caller's changes nothing a fresh import would do); a walk
    whose names are not tested so (a copy) binds every variable it read."""
    monkeypatch.setenv("TPL_P_MININTERVAL", "3")
    monkeypatch.setenv("TPL_T_UNRELATED", "1")
    importenv.start_done()
    _import(
        tracked,
        "tpl_t_prefixed",
        "import os\nFOUND = {k: v for k, v in os.environ.items() if k.startswith('TPL_P_')}\n",
    )
    assert importenv.bound == {"TPL_P_MININTERVAL": "3"}
    monkeypatch.setenv("TPL_T_UNRELATED", "2")
    assert importenv.differs() == ("", False)
    monkeypatch.setenv("TPL_P_MININTERVAL", "4")
    assert importenv.differs() == ("TPL_P_MININTERVAL", False)
    copied = _import(tracked, "tpl_t_copied", "import os\nSNAPSHOT = dict(os.environ)\n")
    assert "TPL_T_UNRELATED" in importenv.bound
    assert not any(getattr(k, "_walk", None) for k in copied.SNAPSHOT)  # type: ignore[attr-defined]


def test_start_up_bindings_are_marked_and_a_library_s_own_variable_binds_nothing(
    tracked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TPL_T_OWN", raising=False)
    monkeypatch.setenv("TPL_T_START", "a")
    _import(tracked, "cpq_t_start", "import os\nos.environ.get('TPL_T_START')\n")
    _import(tracked, "cpq_t_own", "import os\nos.environ.setdefault('TPL_T_OWN', '1')\n")
    assert "TPL_T_OWN" not in importenv.bound  # set by the import itself
    monkeypatch.setenv("TPL_T_START", "b")
    assert importenv.differs() == ("TPL_T_START", True)


def test_a_test_file_executed_by_path_counts_as_an_import(tracked: Path) -> None:
    with importenv.importing():
        os.environ.get("TPL_T_FILE")
    assert importenv.bound == {"TPL_T_FILE": None}


def test_the_caller_s_random_state_travels_and_is_installed() -> None:
    random.seed(7)
    numpy.random.seed(7)
    state = protocol.unpack(protocol.pack(rng.capture()))  # as it crosses the wire
    expected = [random.random(), float(numpy.random.rand())]
    random.seed(1)
    numpy.random.seed(1)
    rng.install(state)
    assert [random.random(), float(numpy.random.rand())] == expected


def test_a_state_nothing_set_keeps_the_fixed_seed() -> None:
    snapshot = rng.Snapshot()
    assert not snapshot.changed()
    random.seed(3)  # what pytest-randomly or a user's fixture does
    assert snapshot.changed()


def test_own_groups_take_only_groups_of_their_session() -> None:
    sim = Sim()
    sim.client(b"c1", features=FEATURES)
    sim.client(b"c2", features=FEATURES)
    pool = spec(1)

    def submit(client: bytes, task_id: str, own: bool) -> None:
        message = protocol.Submit(
            task_id=task_id, target="m:f", spec=pool, session=client.decode(), own_groups=own
        )
        sim.client_send(client, message)

    submit(b"c1", "t1", own=False)
    sim.bring_up("g1")
    sim.finish_all("g1", "t1")
    assert sim.states() == {"g1": "idle"}
    submit(b"c2", "t2", own=True)  # g1 served session c1: a new group, not g1
    assert sim.running("g1") is None and "g2" in sim.states()
    sim.bring_up("g2")
    assert sim.running("g2") == "t2"
    sim.finish_all("g2", "t2")
    submit(b"c1", "t3", own=True)  # g1 served only c1: it may serve c1 again
    assert sim.running("g1") == "t3"


def test_own_groups_evict_idle_groups_of_other_sessions_when_they_fill_the_room() -> None:
    """Idle groups of the spec that served another session fill the room (--memory): they can
    never take an own-groups task, so one is evicted for it (before, the task waited for good
    while the notice said "none yet")."""
    sim = Sim(memory_mb=300.0)  # one measured ws=2 group
    sim.client(b"c1", features=FEATURES)
    sim.client(b"c2", features=FEATURES)
    pool = spec(2)

    def submit(client: bytes, task_id: str, own: bool) -> None:
        message = protocol.Submit(
            task_id=task_id, target="m:f", spec=pool, session=client.decode(), own_groups=own
        )
        sim.client_send(client, message)

    submit(b"c1", "t1", own=False)
    sim.bring_up("g1")
    sim.finish_all("g1", "t1")
    submit(b"c2", "t2", own=True)
    assert sim.states()["g1"] == "stopping"  # evicted: it served c1
    sim.tick(1.0)  # reaped: its ranks are back
    assert "g1" not in sim.states() and sim.states()["g2"] == "starting"
    sim.bring_up("g2")
    assert sim.running("g2") == "t2"
    assert sim.done(b"c2") == {} and sim.errors(b"c2") == []


def test_the_waiting_notice_names_idle_groups_an_own_groups_task_cannot_take() -> None:
    sim = Sim(max_ranks=2)
    sim.client(b"c1", features=FEATURES)
    sim.submit(pool_spec=spec(2), task_id="t1", session="c1")
    sim.bring_up("g1")
    sim.finish_all("g1", "t1")
    group = sim.broker.pools.groups["g1"]
    text = notices.why(spec(2), sim.broker.pools, 1, own_session="c2")
    assert "1 idle but served other sessions" in text, text
    assert group.sessions == {"c1"} and "none yet" not in text
    assert "served other sessions" not in notices.why(spec(2), sim.broker.pools, 1, "c1")


def test_a_variable_bound_at_start_ends_in_an_error_naming_cpq_spec_env() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    task = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    result = protocol.RankResult(rank=0, outcome="error")
    message = protocol.RankDone(
        task_id=task, result=result, stale="PYTORCH_JIT", stale_kind="variable", stale_start=True
    )
    sim.rank_send(sim.rank_id("g1", 0), message)
    (verdict,) = sim.done().values()
    assert verdict.outcome == "error" and "CPQ_SPEC_ENV=PYTORCH_JIT" in verdict.message
    assert sim.states() == {"g1": "idle"}  # a fresh group would read the same: kept


def test_a_variable_bound_at_start_joins_the_spec_with_the_callers_value() -> None:
    """The caller has a value the group's start-up imports read otherwise: the task goes,
    in front, to a group started with the caller's value, and so do the spec's later tasks
    (one bounce per spec, not per task); a caller without the variable is not widened."""
    sim = Sim()
    sim.client(features=FEATURES)
    caller = {"PYTORCH_JIT": "0", "HOME": "/h"}
    task = sim.submit(pool_spec=spec(1), env=caller)
    sim.bring_up("g1")
    result = protocol.RankResult(rank=0, outcome="error")
    message = protocol.RankDone(
        task_id=task, result=result, stale="PYTORCH_JIT", stale_kind="variable", stale_start=True
    )
    sim.rank_send(sim.rank_id("g1", 0), message)
    assert sim.done() == {}  # not a verdict: a bounce
    widened = sim.broker.pools.groups["g2"].spec
    assert ["PYTORCH_JIT", "0"] in widened.env and sim.states()["g1"] == "idle"
    sim.bring_up("g2")
    assert sim.running("g2") == task
    sim.finish_all("g2", task)
    later = sim.submit(pool_spec=spec(1), env=caller)
    assert sim.running("g2") == later  # straight to the widened spec's group
    sim.finish_all("g2", later)
    bare = sim.submit(pool_spec=spec(1), env={"HOME": "/h"})
    assert sim.running("g1") == bare  # no value to start with: the spec as sent


def test_bound_names_and_coverage_reach_status_and_verdict() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    task = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    result = protocol.RankResult(rank=0, outcome="passed")
    message = protocol.RankDone(
        task_id=task, result=result, bound_env=["TPLIB_MODE"], coverage=b"data"
    )
    sim.rank_send(sim.rank_id("g1", 0), message)
    (verdict,) = sim.done().values()
    assert verdict.coverage == [b"data"]
    assert sim.broker.pools.groups["g1"].bound_env == {"TPLIB_MODE"}


def test_an_older_peer_gets_none_of_the_new_fields() -> None:
    submit = protocol.Submit(
        task_id="t", target="m:f", spec=spec(1), rng={"random": []}, coverage={}, own_groups=True
    )
    old = frozenset(protocol.ALL_FEATURES) - {"task-rng", "task-coverage", "session-groups"}
    wire = protocol.unpack(protocol.encode_for(submit, old))
    assert not {"rng", "coverage", "session", "own_groups"} & set(wire)


def test_a_client_without_rank_report_gets_every_rank_without_its_report() -> None:
    """``result.ranks.report``: the field is dropped from each rank of the list, and what is
    left decodes; a peer that reads it gets every rank's report."""
    ranks = [
        protocol.RankResult(rank=r, outcome="failed", report=f"E   assert {r} == 9")
        for r in range(2)
    ]
    done = protocol.Done(result=protocol.TaskResult(task_id="t", outcome="failed", ranks=ranks))
    old = frozenset(protocol.ALL_FEATURES) - {"rank-report"}
    wire = protocol.unpack(protocol.encode_for(done, old))
    assert [set(r) & {"report"} for r in wire["result"]["ranks"]] == [set(), set()]
    assert wire["result"]["ranks"][1]["rank"] == 1
    new = protocol.decode(protocol.encode_for(done, protocol.ALL_FEATURES))
    assert isinstance(new, protocol.Done)
    assert [r.report for r in new.result.ranks] == ["E   assert 0 == 9", "E   assert 1 == 9"]
