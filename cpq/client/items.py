"""The pytest process's half of "the ranks run pytest" (docs/design.md).

A test that runs on the ranks (a ``cpq`` marker, or every test under ``--cpq-world-size N``)
is not set up here at all: its fixtures, class setup, warning filters and capture run in
every rank's own pytest session (:mod:`cpq.rank.items`). This process still walks pytest's
protocol for the item — setup, call, teardown — so every plugin here (rerun plugins,
pytest-timeout, ``--pdb``, JUnit, xdist, ``-x``) sees a test as it always does, but each phase
is hollow: *setup* sends the test to the ranks and waits for their reports, *call* and
*teardown* replay them. Each phase's report is the ranks' reports combined
(:mod:`cpq.client.combine`), handed to pytest in place of the hollow one; the warnings the
ranks raised go to this session's warnings summary, once each.

A phase raises here what the ranks' phase ended in (a failure, a skip), so pytest's flow
(no call after a failed setup) and ``--pdb`` (a failed phase opens the post-mortem, relayed to
the failing rank) behave as they do for a local test. A verdict without reports (a deadline,
a dead rank, the broker gone) fails the call phase as cpq's infra error, as before.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from cpq import protocol
from cpq.client import combine, confirm, reruns, timeouts
from cpq.client.report import BrokerGone, CpqTaskFailed, report_result
from cpq.protocol import TaskResult

#: What the ranks run (``cpq.rank.items.run_item``).
TARGET = protocol.PYTEST_ITEM_TARGET
WORLD_SIZE_VAR = "CPQ_WORLD_SIZE"


class RanksFailed(CpqTaskFailed):
    """A phase failed on the ranks; its report is the ranks' combined report."""


@dataclass
class Placement:
    """Where a test runs: on ``world_size`` ranks, with the marker's deadline and variables."""

    world_size: int
    timeout: float | None = None
    env: dict[str, str] | None = None


@dataclass
class _Run:
    """One protocol run of an item on the ranks (a rerun plugin makes several)."""

    #: Sends the test to the ranks (``fresh_group=True``: to a group started for it).
    submit: Callable[..., TaskResult]
    #: Called with a failed verdict whose rank waits for a post-mortem (``--pdb``).
    debugger: Callable[[TaskResult], None]
    kwargs: dict[str, Any]
    world_size: int
    result: TaskResult | None = None
    phases: dict[str, pytest.TestReport] = field(default_factory=dict)
    #: Why nothing was sent (the broker is gone), raised in the call phase.
    refused: BaseException | None = None


class Unusable(Exception):
    """A test cpq cannot run as asked (a marker it cannot use, a pytest it does not support):
    that test fails with the reason, before anything of it runs; the session goes on."""


#: The ``cpq`` marker's arguments.
MARKER_ARGS = ("world_size", "timeout", "env", "affinity", "own_groups")
#: The pytest versions whose sessions the ranks rebuild: [first, first unsupported). The
#: same bounds as pyproject's ``pytest`` requirement (tests/unit/test_pytest_versions.py).
PYTEST_SUPPORTED = ((8, 2), (10, 0))


def marker_args(item: pytest.Item) -> tuple[int, float | None, dict[str, str] | None] | None:
    """The ``cpq`` marker's world size, timeout and variables (None: no marker); a marker cpq
    cannot use raises :class:`Unusable` naming the problem."""
    marker = item.get_closest_marker("cpq")
    if marker is None:
        return None
    kwargs = dict(marker.kwargs)
    if len(marker.args) > 1:
        raise Unusable(f"cpq marker: one positional argument (world_size), got {marker.args!r}")
    if marker.args:
        kwargs.setdefault("world_size", marker.args[0])
    unknown = sorted(set(kwargs) - set(MARKER_ARGS))
    if unknown:
        raise Unusable(
            f"cpq marker: unknown argument(s) {', '.join(unknown)} "
            f"(it takes {', '.join(MARKER_ARGS)})"
        )
    world_size = kwargs.get("world_size", 2)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise Unusable(f"cpq marker: world_size must be an int of at least 1, got {world_size!r}")
    timeout = kwargs.get("timeout")
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout < 1e9
    ):
        raise Unusable(f"cpq marker: timeout must be a positive number of seconds, got {timeout!r}")
    env = kwargs.get("env")
    if env is not None and (
        not isinstance(env, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise Unusable(f"cpq marker: env must be a dict of strings, got {env!r}")
    return world_size, None if timeout is None else float(timeout), env


def check_pytest(version: str = pytest.__version__) -> None:
    """Fail closed on a pytest whose sessions the ranks were not built to rebuild."""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        found = (0, 0)
    first, beyond = PYTEST_SUPPORTED
    if not first <= found < beyond:
        raise Unusable(
            f"cpq runs tests on the ranks with pytest {first[0]}.{first[1]} up to (not "
            f"including) {beyond[0]}.{beyond[1]}; this is pytest {version} "
            "(pip install 'pytest>=8.2,<10')"
        )


RUN_KEY = pytest.StashKey[_Run]()
SETUP_KEY = pytest.StashKey[tuple[str, dict[str, Any]]]()


def add_options(parser: pytest.Parser, group: Any) -> None:
    group.addoption(
        "--cpq-world-size",
        type=int,
        default=None,
        metavar="N",
        help="run every test on N ranks, as torchrun --nproc-per-node N -m pytest would "
        "(CPQ_WORLD_SIZE; a marker still sets one test's)",
    )
    parser.addini("cpq_world_size", "run every test on this many ranks", default="")


def default_world_size(config: pytest.Config) -> int | None:
    """``--cpq-world-size``, else ``CPQ_WORLD_SIZE``, else the ini's (None: marker tests only)."""
    value: Any = config.getoption("cpq_world_size", None)
    if value is None:
        value = os.environ.get(WORLD_SIZE_VAR) or config.getini("cpq_world_size") or None
    if value is None:
        return None
    return reruns.whole_number(value, "cpq world size", least=1)


def rank_setup(config: pytest.Config, session_id: str) -> tuple[str, dict[str, Any]]:
    """The calling session's configuration as the ranks rebuild it, and the key that names
    this pytest process's session in every rank (computed once)."""
    known = config.stash.get(SETUP_KEY, None)
    if known is not None:
        return known
    options: dict[str, Any] = {}
    for name, value in vars(config.option).items():
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        elif isinstance(value, list | tuple):
            value = [os.fspath(v) if isinstance(v, os.PathLike) else v for v in value]
        if not protocol.travel_problem(value):
            options[name] = value
    setup = {
        "dir": str(config.invocation_params.dir),
        "rootdir": str(config.rootpath),
        "inifile": str(config.inipath) if config.inipath else "",
        # What this session collects (the paths and node ids it was given, or the ini's
        # testpaths, as pytest resolved them): the ranks collect the same.
        "args": [str(arg) for arg in config.args],
        "options": options,
        "pytest": pytest.__version__,
        # pytest-timeout is on here: the ranks time a test themselves (cpq.rank.timeouts)
        "timeout": config.pluginmanager.hasplugin("timeout"),
    }
    digest = hashlib.sha256(repr(sorted(setup.items())).encode()).hexdigest()[:12]
    known = (f"{session_id}:{os.getpid()}:{digest}", setup)
    config.stash[SETUP_KEY] = known
    return known


def prepare(
    item: pytest.Item,
    placement: Placement,
    nextitem: pytest.Item | None,
    session_key: str,
    setup: dict[str, Any],
    submit: Callable[..., TaskResult],
    debugger: Callable[[TaskResult], None],
) -> None:
    """Make ``item``'s phases hollow for this protocol run (undone by :func:`restore`)."""
    kwargs = {
        "session": session_key,
        "setup": setup,
        "nodeid": item.nodeid,
        "path": str(item.path),
        "next": nextitem.nodeid if nextitem is not None else None,
    }
    item.stash[RUN_KEY] = _Run(submit, debugger, kwargs, placement.world_size)
    item.stash[timeouts.ON_RANKS_KEY] = True  # pytest-timeout's timer is the ranks' deadline
    timeouts.reset_spent(item)  # this protocol run's timer is not spent yet
    item.setup = functools.partial(_setup, item)  # type: ignore[method-assign]
    item.runtest = functools.partial(_call, item)  # type: ignore[method-assign]
    # skip, skipif and xfail are the ranks' to evaluate (a condition may read RANK or
    # WORLD_SIZE, as it does in a fresh run): this process's skipping plugin sees none.
    every = item.iter_markers

    def iter_markers(name: str | None = None) -> Any:
        return (mark for mark in every(name) if mark.name not in RANKS_DECIDE)

    item.iter_markers = iter_markers  # type: ignore[method-assign]


#: Marks whose conditions the ranks evaluate (``torchrun -m pytest`` evaluates them there).
RANKS_DECIDE = frozenset({"skip", "skipif", "xfail"})


def restore(item: pytest.Item) -> None:
    for name in ("setup", "runtest", "iter_markers"):
        item.__dict__.pop(name, None)
    if RUN_KEY in item.stash:
        del item.stash[RUN_KEY]
    if timeouts.ON_RANKS_KEY in item.stash:
        del item.stash[timeouts.ON_RANKS_KEY]
    timeouts.reset_spent(item)


def _setup(item: pytest.Item) -> None:
    """The setup phase: the whole test runs on the ranks; raise what their setup ended in."""
    run = item.stash[RUN_KEY]
    run.phases, run.refused = {}, None
    confirm.forget(item)
    try:
        kwargs = run.kwargs
        if reruns.rerun_may_follow(item):  # sent only then: an older rank reads no "rerun"
            kwargs = {**kwargs, "rerun": True}
        if timeouts.spent(item):  # an attempt after a failure: pytest-timeout times none
            kwargs = {**kwargs, "untimed": True}
        if item.get_closest_marker("cpq") is not None:  # its group is initialised (README)
            kwargs = {**kwargs, "marked": True}
        run.result = result = run.submit(kwargs)
        phases = _phases(item, run, result)
        if phases is not None and confirm.wanted(item.config, result, _failed(phases)):
            warm = confirm.warm_text(result, [r.longreprtext for r in phases.values() if r.failed])
            run.result = result = run.submit(kwargs, fresh_group=True)
            phases = _phases(item, run, result)
            confirm.note(item, phases is None or _failed(phases), warm)
    except BrokerGone as exc:  # one line, in the call phase (a timeout's fails the setup)
        run.refused = exc
        return
    if phases is None:
        if result.phase == "setup":  # a deadline found the ranks in a fixture's setup
            _infra(item, result)
        return  # no reports: the call phase says what happened (cpq's infra error)
    run.phases = phases
    _record_warnings(item, result)
    _raise_for(item, result, phases.get("setup"))


def _phases(item: pytest.Item, run: _Run, result: TaskResult) -> dict[str, Any] | None:
    if item.config.getoption("capture", "fd") == "no":
        stream_output(result)
    return combine.phases(result, run.world_size, item.config)


def _failed(phases: dict[str, pytest.TestReport]) -> bool:
    return any(r.failed for r in phases.values())


def _call(item: pytest.Item) -> None:
    run = item.stash[RUN_KEY]
    if run.refused is not None:
        raise run.refused
    result = run.result
    assert result is not None
    if not run.phases:
        _infra(item, result)
    _raise_for(item, result, run.phases.get("call"))


def _infra(item: pytest.Item, result: TaskResult) -> None:
    """A verdict without the ranks' reports: pytest-timeout's failure, or cpq's error."""
    timeouts.fail_if_timed_out(item, result)
    _offer_debugger(item, result)
    report_result(item, result, item.nodeid)
    raise CpqTaskFailed(result, item.nodeid)  # passed without reports: fail closed


def _raise_for(item: pytest.Item, result: TaskResult, report: pytest.TestReport | None) -> None:
    if report is None or report.passed or hasattr(report, "wasxfail"):
        return
    if report.failed:
        _offer_debugger(item, result)
        raise RanksFailed(result, item.nodeid)
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else "skipped"
    raise pytest.skip.Exception(str(reason), _use_item_location=True)


def _offer_debugger(item: pytest.Item, result: TaskResult) -> None:
    if result.debug_rank >= 0:  # a rank waits for pytest's --pdb (cpq.client.pdb_relay)
        item.stash[RUN_KEY].debugger(result)


def phase_report(item: pytest.Item, when: str) -> pytest.TestReport | None:
    """The ranks' combined report of this phase, to stand for the hollow local one."""
    run = item.stash.get(RUN_KEY, None)
    if run is None or not run.phases:
        return None
    report = run.phases.get(when)
    if report is None:
        return None
    report.location = item.location
    notes = run.result.notes if run.result is not None else []
    first = "call" if "call" in run.phases else "setup"
    section = (f"Captured stderr {first}", "\n".join(notes) + "\n")
    if notes and when in (first, "teardown") and section not in report.sections:
        # In the captured stderr of this phase and the last (whose sections are all of the
        # test's, as pytest's are), so JUnit's <system-err> has them. Asked twice a phase
        # (plugin._RanksReports, then the makereport wrapper): added once.
        report.sections.append(section)
    return report


def hollow_duration(item: pytest.Item, when: str) -> float | None:
    """A phase's duration when the ranks sent no reports (a deadline, cpq's error): the
    local phases are hollow and the setup's holds the whole wait for the verdict, so the
    phase the ranks were in gets the task's time on its group (the broker's measure, no
    queue or spawn in it) and the other gets none; None for a test with reports."""
    run = item.stash.get(RUN_KEY, None)
    if run is None or run.phases or run.result is None or when == "teardown":
        return None
    ran_in = "setup" if run.result.phase == "setup" else "call"
    return run.result.duration_s if when == ran_in else 0.0


def stream_output(result: TaskResult) -> None:
    """Under ``-s`` the ranks' pytest captures nothing: what each rank printed reaches this
    terminal after the test, every line labelled with its rank."""
    for rank in result.ranks:
        for out, text in ((sys.stdout, rank.stdout), (sys.stderr, rank.stderr)):
            if text:
                out.write("".join(f"[rank {rank.rank}] {line}" for line in text.splitlines(True)))
                out.flush()


def _record_warnings(item: pytest.Item, result: TaskResult) -> None:
    """The ranks' warnings into this session's summary, each once however many ranks saw it."""
    seen: set[tuple[Any, ...]] = set()
    for rank in result.ranks:
        for data in rank.warnings:
            key = tuple(data.get(k) for k in ("category", "message", "filename", "lineno"))
            if key in seen:
                continue
            seen.add(key)
            category = _category(str(data.get("category", "")))
            try:
                message: Warning = category(str(data.get("message", "")))
            except Exception:
                category, message = UserWarning, UserWarning(str(data.get("message", "")))
            warning = warnings.WarningMessage(
                message, category, str(data.get("filename", "")), int(data.get("lineno", 0))
            )
            item.ihook.pytest_warning_recorded.call_historic(
                kwargs={
                    "warning_message": warning,
                    "when": str(data.get("when", "runtest")),
                    "nodeid": str(data.get("nodeid", item.nodeid)),
                    "location": None,
                }
            )


def _category(name: str) -> type[Warning]:
    module, _, qualname = name.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:
        return UserWarning
    return found if isinstance(found, type) and issubclass(found, Warning) else UserWarning
