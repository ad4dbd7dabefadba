"""The ranks run pytest: a test's whole protocol, in every rank, as ``torchrun -m pytest``.

The reference for a distributed test is ``torchrun --nproc-per-node N -m pytest``: every rank
is a pytest process that collects the test's module, runs conftest files and fixtures of every
scope, applies warning filters, captures output and reports. So the plugin sends no function
here but a test id (``TARGET``); this module keeps, per calling pytest session, a pytest
session of its own in this rank, made from the caller's configuration
(``cpq.client.items.rank_setup``: invocation directory, rootdir, ini file, option values), and
runs the item's protocol there — setup, call, teardown — with pytest's own runner. The
reports go back serialised as pytest-xdist's workers send theirs
(``pytest_report_to_serializable``), with the warnings the item raised; the pytest process
combines the ranks' reports into the test's (``cpq.client.items``). See docs/design.md, "The
ranks run pytest".

* **Scopes.** Module, class, package and session fixtures live in this rank's session while
  its tests come; each item is torn down towards the caller's *next* test (``next``), as
  pytest tears down towards ``nextitem``.
* **Collection** is the caller's own, once per calling session, from its collection
  arguments, so initial conftests, ``rootdir`` and the one collection tree (pytest 9.1+
  attaches a conftest's fixtures to its directory's node) are the caller's; items are kept
  by node id. An edited module never reaches a cached collection (:mod:`cpq.rank.freshness`).
* **Plugins.** The caller's, except those whose work is the calling process's (terminal,
  cpq, coverage, reruns, xdist; ``--pdb``, ``-x``, ``--lf``, JUnit); pytest-timeout's signal
  method times the test here, as in a fresh rank (:mod:`cpq.rank.timeouts`).
* **Random generators** start each test as a fresh process's do (fresh entropy per rank),
  unless a fixture or a plugin (pytest-randomly, with the caller's seed) seeds them.

Nothing here imports pytest until a test runs: a rank that never runs one pays nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cpq.protocol import PYTEST_ITEM_TARGET
from cpq.rank import generators, pgroups, reset, session_plugins, travel

TARGET = PYTEST_ITEM_TARGET

#: Plugins that do the calling process's work (see the module docstring).
BLOCKED_PLUGINS = (
    "cpq",
    "cpq.client.plugin",  # its name when given as -p (cpq on PYTHONPATH, not installed)
    "pytest_cov",
    "rerunfailures",
    "flaky",
)
#: Options whose effect belongs to the calling process, and what they are in a rank.
RANK_OPTIONS: dict[str, Any] = {
    "usepdb": False,
    "trace": False,
    "numprocesses": None,
    "maxprocesses": None,
    "dist": "no",
    "tx": [],
    "looponfail": False,
    "lf": False,
    "last_failed_no_failures": "all",
    "failedfirst": False,
    "newfirst": False,
    "stepwise": False,
    "stepwise_skip": False,
    "stepwise_reset": False,
    "cacheshow": False,
    "cacheclear": False,
    "xmlpath": None,
    "maxfail": 0,
    "keyword": "",
    "markexpr": "",
    "deselect": [],
    "collectonly": False,
    "strict_markers": False,  # the caller checked its markers at collection
    "showfixtures": False,
    "show_fixtures_per_test": False,
    "markers": False,
    "help": False,
    "version": 0,
    "pastebin": None,
    "durations": None,
    "session_timeout": None,  # pytest-timeout's: the caller's session, not this one
}


@dataclass
class ItemRun:
    """What ran in this rank on the user's behalf — one test's protocol, or a launched
    script (:mod:`cpq.rank.script`) — in the terms :func:`cpq.rank.runtime.run_task`
    reports: an outcome for the broker's table, pytest's reports, a value."""

    outcome: str  # passed | failed | skipped, for the broker's table
    reports: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    #: (type, first line, text) of the first failure, for the broker's verdict message.
    error: tuple[str, str, str] | None = None
    #: The failing exception (its frames), for a post-mortem (``pytest --pdb``).
    failure: BaseException | None = None
    #: What the rank reports as its value (a launch's exit code, :mod:`cpq.rank.script`).
    value: Any = None


#: The phase of the test running now ("" between tests), for a deadline's stack report.
phase = ""


def _phase_plugin() -> Any:
    """A plugin that keeps :data:`phase` (pytest imported only when a session starts)."""
    import pytest

    def within(name: str) -> Any:
        __tracebackhide__ = True  # cpq's, not the test's: a fresh run's report has no such frame
        global phase
        phase = name
        try:
            return (yield)
        finally:
            phase = ""

    class Phases:
        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_setup(self, item: Any) -> Any:
            __tracebackhide__ = True
            return (yield from within("setup"))

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_call(self, item: Any) -> Any:
            __tracebackhide__ = True
            return (yield from within("call"))

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_teardown(self, item: Any) -> Any:
            __tracebackhide__ = True
            return (yield from within("teardown"))

    return Phases()


class _Next:
    """Stands for the caller's next test in ``teardown_exact``: the chain of this item's
    nodes that are also the next test's, so pytest tears down exactly what it would."""

    def __init__(self, chain: list[Any]) -> None:
        self._chain = chain

    def listchain(self) -> list[Any]:
        return self._chain


def _shared_chain(item: Any, next_nodeid: str | None) -> list[Any] | None:
    """``item``'s nodes that the test ``next_nodeid`` also descends from (None: no next)."""
    if next_nodeid is None:
        return None
    return [
        node
        for node in item.listchain()
        if node.nodeid in ("", ".")  # the session, the rootdir's Dir (pytest 8.1+)
        or next_nodeid.startswith(node.nodeid + "::")
        or next_nodeid.startswith(node.nodeid + "/")
    ]


class RankSession:
    """One calling session's pytest session in this rank."""

    def __init__(self, key: str, setup: dict[str, Any], rank: int) -> None:
        import pytest
        from _pytest.config import Config
        from _pytest.main import Session

        caller = setup.get("pytest")
        if caller and caller != pytest.__version__:  # fail closed: one pytest builds both
            raise RuntimeError(
                f"cpq: this rank runs pytest {pytest.__version__}, the calling process pytest "
                f"{caller}: the ranks rebuild the caller's session with the caller's pytest "
                "(same interpreter and packages); start the groups again (`cpq stop`)"
            )
        self.key = key
        self.dir = str(setup["dir"])
        os.chdir(self.dir)  # the invocation directory: conftest and relative paths
        options = dict(setup.get("options") or {})
        options.update(RANK_OPTIONS)
        # The positional arguments are given as such below (an empty list here makes
        # argparse warn "Do not expect file_or_dir" on the rank's stderr).
        options.pop("file_or_dir", None)
        if options.get("basetemp"):  # each rank its own, as each fresh process has
            base = str(options["basetemp"])
            # The caller's may not exist yet (an xdist worker's, made when first used there;
            # pytest makes only the last level of a given one).
            os.makedirs(base, exist_ok=True)
            options["basetemp"] = os.path.join(base, f"rank{rank}-{os.getpid()}")
        args: list[str] = []
        blocked = BLOCKED_PLUGINS if setup.get("timeout") else (*BLOCKED_PLUGINS, "timeout")
        for name in blocked:
            args += ["-p", f"no:{name}"]
        if setup.get("rootdir"):
            args += ["--rootdir", str(setup["rootdir"])]
        if setup.get("inifile"):
            args += ["-c", str(setup["inifile"])]
        # The caller's collection arguments, as it resolved them (its paths and node ids, or
        # its ini's testpaths): initial conftests and the tree collected are the caller's.
        args += [str(arg) for arg in setup.get("args") or ()]
        self.config = Config.fromdictargs(options, args)
        self.recorder = session_plugins.Recorder()
        self.config.pluginmanager.register(self.recorder, "cpq-rank-recorder")
        self.config.pluginmanager.register(_phase_plugin(), "cpq-rank-phases")
        from cpq.rank import rerun_keep

        self.keep = rerun_keep.plugin()
        self.config.pluginmanager.register(self.keep, "cpq-rank-rerun-keep")
        from cpq.rank import timeouts  # imports pytest: only where a test runs

        self.timer = timeouts.InRank()
        self.config.pluginmanager.register(self.timer, "cpq-rank-timeouts")
        self.config._do_configure()
        self._silence_terminal()
        for name in ("lfplugin", "nfplugin", "stepwiseplugin"):  # the caller's cache only
            plugin = self.config.pluginmanager.get_plugin(name)
            if plugin is not None:
                self.config.pluginmanager.unregister(plugin)
        self.groups_before = {id(pg) for pg in pgroups.made_groups()}
        self.session = Session.from_config(self.config)
        self.config.hook.pytest_sessionstart(session=self.session)
        self.items: dict[str, Any] = {}
        #: Why this rank's collection failed as a whole (None: it did not, or not yet).
        self.collect_error: str | None = None
        self.collected = False
        #: ``random``/numpy/torch states kept while another kind of task ran here (None:
        #: the live generators are this session's own).
        self.generators: dict[str, Any] | None = None
        #: Whether a test of this session ran here (its first starts the generators fresh).
        self.begun = False

    def _silence_terminal(self) -> None:
        """Reporting is the calling process's: pytest's terminal reporter is replaced by one
        that writes nowhere and runs no hooks (its per-phase bookkeeping cost ~0.1 ms a
        phase), keeping what others ask of it — a writer for assertion explanations."""
        from _pytest._io import TerminalWriter

        manager = self.config.pluginmanager
        reporter = manager.get_plugin("terminalreporter")
        if reporter is None:
            return
        self._devnull = open(os.devnull, "w")  # noqa: SIM115 - closed in close()
        writer = TerminalWriter(self._devnull)
        writer.hasmarkup = False
        manager.unregister(reporter)
        manager.register(session_plugins.QuietReporter(self.config, writer), "terminalreporter")

    def item(self, nodeid: str, path: str) -> Any:
        """The item ``nodeid`` (of the file ``path``), collecting the caller's arguments on
        this session's first test; a str saying why there is none."""
        if not self.collected:
            self._collect()
        item = self.items.get(nodeid)
        if item is not None:
            return item
        if self.collect_error is not None:
            return self.collect_error
        file_id = nodeid.partition("::")[0]
        failures = "\n".join(
            str(r.longrepr)
            for r in self.recorder.collect_failures
            if r.nodeid in ("", ".") or file_id == r.nodeid or file_id.startswith(r.nodeid + "/")
        )
        return f"this rank collected no test {nodeid} from {path}" + (
            f":\n{failures}" if failures else " (its ids differ from the calling process's)"
        )

    def _collect(self) -> None:
        """Collect what the caller collected, as pytest's main loop does (the
        ``pytest_collection`` hook: assertion rewriting learns the session's initial paths
        there); a module's failure is kept for its own tests, the others run."""
        self.collected = True
        self.recorder.collect_failures = []
        try:
            self.config.hook.pytest_collection(session=self.session)
        except Exception as exc:  # UsageError (an argument not found) and the like
            args = " ".join(str(arg) for arg in self.config.args)
            self.collect_error = f"collecting {args} failed in this rank: {exc}"
        for each in getattr(self.session, "items", None) or ():
            self.items.setdefault(each.nodeid, each)
            _note_test_module(getattr(each, "module", None))
        # The caller reported its own collection's warnings; the first test's are its own.
        self.recorder.clear()

    def run(
        self, item: Any, next_nodeid: str | None, untimed: bool = False, rerun: bool = False
    ) -> None:
        """Run ``item``'s protocol, torn down towards ``next_nodeid`` (the caller's next);
        ``untimed``: pytest-timeout arms no timer for it (:class:`~cpq.rank.timeouts.InRank`);
        ``rerun``: a rerun may follow, which a failed attempt leaves its module's fixtures
        standing for (:mod:`cpq.rank.rerun_keep`)."""
        self.keep.rerun_may_follow, self.keep.failed = rerun, False
        state = self.session._setupstate
        if state.stack:
            # Left standing by a test whose next one ran elsewhere (on another group, or in
            # the calling process): end what this test does not share before it starts.
            mine = item.listchain()
            shared = [node for node in state.stack if node in mine]
            stand_in: Any = _Next(shared)
            state.teardown_exact(stand_in)
        nextitem = self.items.get(next_nodeid) if next_nodeid is not None else None
        if nextitem is None and next_nodeid is not None:  # a test this rank did not collect
            chain = _shared_chain(item, next_nodeid)
            nextitem = None if chain is None else _Next(chain)
        self.timer.untimed = untimed
        try:
            item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        finally:
            self.timer.untimed = False

    def close(self) -> None:
        """Finish the session: fixtures still standing are torn down, plugins unconfigured."""
        os.chdir(self.dir)
        conftests = getattr(self.config.pluginmanager, "_conftest_plugins", ())
        for module in list(conftests):  # imported again by the next session, as test modules
            _note_test_module(module)
        # What pytest's own main would end this rank's session with (_pytest.main._main):
        # a conftest's sessionfinish that keeps artefacts of a failing rank reads it.
        import pytest

        session = self.session
        if session.shouldfail:  # pytest_runtestloop's Failed (-x, --maxfail)
            status = pytest.ExitCode.TESTS_FAILED
        elif session.shouldstop:  # its Interrupted (a plugin's stop, stepwise)
            status = pytest.ExitCode.INTERRUPTED
        elif session.testsfailed:
            status = pytest.ExitCode.TESTS_FAILED
        elif session.testscollected == 0:
            status = pytest.ExitCode.NO_TESTS_COLLECTED
        else:
            status = pytest.ExitCode.OK
        session.exitstatus = status
        try:
            self.config.hook.pytest_sessionfinish(session=session, exitstatus=status)
        finally:
            self.config._ensure_unconfigure()
            pgroups.caller_done(self.groups_before)  # what its fixtures made and left
            devnull = getattr(self, "_devnull", None)
            if devnull is not None:
                devnull.close()


_current: RankSession | None = None
#: Set by the runtime for each task: tells the broker the test's own protocol begins.
began: Callable[[], None] | None = None
#: Test modules pytest imported here: name -> (file, its stamp then).
_test_modules: dict[str, tuple[str, tuple[int, int]]] = {}
#: The top-level names of every test module and conftest pytest imported here, ever: never
#: imported ahead of a session (:mod:`cpq.rank.ahead`; pytest imports them itself).
test_tops: set[str] = set()


def _stamp(path: str) -> tuple[int, int]:
    try:
        info = os.stat(path)
    except OSError:
        return (-1, -1)
    return (info.st_mtime_ns, info.st_size)


def _note_test_module(module: Any) -> None:
    """A test module is a leaf only pytest imports: an edit of it needs no fresh group. The
    code check skips it; the next calling session imports it again if it changed."""
    from cpq.rank import freshness

    path = getattr(module, "__file__", None)
    if module is None or not isinstance(path, str) or module.__name__ in _test_modules:
        return
    _test_modules[module.__name__] = (path, _stamp(path))
    test_tops.add(module.__name__.partition(".")[0])
    freshness.reexecuted.add(module.__name__)


def _forget_test_modules() -> None:
    """A new calling session imports its test modules and conftest files again, as a fresh
    process does: their module-level state (a counter, a cache) starts anew, and an edited
    test module is read again. Libraries and helpers stay loaded (the group's warmth)."""
    from cpq.rank import exits

    for name in list(_test_modules):
        sys.modules.pop(name, None)
        del _test_modules[name]
        exits.gone.add(name)  # its atexit handlers run at the boundary


def _session_for(key: str, setup: dict[str, Any], rank: int) -> RankSession:
    global _current
    if _current is not None and _current.key != key:
        close_current()
    if _current is None:
        _forget_test_modules()  # as a fresh process would import them
        # A fresh torchrun worker's default group is not initialised until the code does it.
        pgroups.unshown()
        # A new calling session starts from a fresh process's state: no cached CUDA blocks
        # of the last one, Transformer Engine's process-wide state reset.
        reset.release_cuda_cache()
        reset.reset_transformer_engine()
        _current = RankSession(key, setup, rank)
    os.chdir(_current.dir)
    return _current


def run_item(
    session: str,
    setup: dict[str, Any],
    nodeid: str,
    path: str,
    next: str | None = None,
    rerun: bool = False,
    untimed: bool = False,
    marked: bool = False,
) -> ItemRun:
    """Run test ``nodeid`` (of the file ``path``) through this rank's pytest session of the
    calling ``session``; ``next`` is the caller's next test id (None: its last test);
    ``rerun``: the caller's rerun plugin may run this test again after this attempt;
    ``untimed``: an earlier attempt's failure spent pytest-timeout's timer (``InRank``);
    ``marked``: a ``@pytest.mark.cpq`` test, whose default group is initialised.

    An empty ``nodeid`` opens the session and collects, running no test: the calling
    process sends it while it collects itself (:mod:`cpq.client.opening`), so its first test
    finds the session built. Collection then sees the caller's environment before any test,
    as a fresh rank's does (no ``PYTEST_CURRENT_TEST``). A module that failed to collect is
    reported with its own tests, as ever; the value is the number of items collected."""
    rank = int(os.environ.get("RANK", "0"))
    current = _session_for(session, setup, rank)
    current.recorder.clear()
    if not nodeid:
        if not current.collected:
            current._collect()
        return ItemRun("passed", value=len(current.items))
    item = current.item(nodeid, path)
    if isinstance(item, str):
        return _not_collected(current, nodeid, item)
    # The generators go on from where this session's previous test left them, as in one
    # pytest process of a fresh run; a session's first test on this rank starts them fresh.
    # They are read out (a CUDA copy) only when another kind of task is about to run here.
    if not current.begun:
        current.begun = True
        generators.start_fresh()
    elif current.generators is not None:
        generators.restore(current.generators)
        current.generators = None
    if marked:
        pgroups.shown()
    if began is not None:
        began()  # the deadline runs from here (cpq.rank.runtime sends it)
    current.run(item, next, untimed, rerun)
    ran = _item_run(current, rank)
    # The caller's last test: its session ends here now (unless a rerun of it may come).
    if next is None and not _rerun_may_come(rerun, ran):
        global session_ended
        if began is not None:
            # The test's protocol is over (its session fixtures torn down with it): what
            # follows, pytest's session finish and unconfigure (a gc pass per plugin, the
            # boundary's checks), pytest-timeout does not time in a fresh run; the broker
            # gives it a window of the test's timeout of its own.
            began()
        close_current()
        session_ended = True
    return ran


def _rerun_may_come(rerun: bool, ran: ItemRun) -> bool:
    """Whether the session must stay open after its last test for a rerun of it.

    A fresh run's rerun plugin reruns a test in the same process: the modules (their state)
    and the fixtures it kept standing (:mod:`cpq.rank.rerun_keep`) are the first attempt's.
    So when the caller's rerun plugin may rerun its last test, the
    session stays open here — the teardown done, its modules kept — when this rank failed
    it, or when other ranks might have (the caller reruns on every rank when any failed).
    It ends with the rerun's attempt, or when another caller or a launch comes
    (:func:`ends_current`; the boundary's checks run then)."""
    if not rerun:
        return False
    return ran.outcome == "failed" or int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_item_task(target: str) -> bool:
    """Whether a task is a test this module runs (its session keeps its own state)."""
    return target == TARGET


#: Set when the caller's last test ran here and its session was closed at once (read and
#: cleared by the runtime, which then checks what the session left: cpq.rank.carryover).
session_ended = False


def ends_current(task: Any) -> bool:
    """Whether ``task`` (a test of another calling session, or a launch) means the session
    whose tests ran here is over (its caller moved on without a last test here)."""
    if _current is None:
        return False
    if task.target != TARGET:
        return str(task.target).startswith("cpq.rank.script:")
    return not isinstance(task.kwargs, dict) or task.kwargs.get("session") != _current.key


def close_current() -> None:
    """Finish the session whose tests ran here (fixtures still standing torn down, its test
    modules forgotten), so that what it leaves can be checked before another caller."""
    global _current
    if _current is None:
        return
    previous, _current = _current, None
    try:
        previous.close()
    except Exception:
        import logging

        logging.getLogger("cpq.rank").exception("finishing the previous session failed")
    _forget_test_modules()


def in_session() -> bool:
    """Whether a calling session's tests run here (its code is what its first test saw)."""
    return _current is not None


def continues(task: Any) -> bool:
    """Whether ``task`` is the next test of the calling session whose tests run here now."""
    return _current is not None and _current.begun and of_current(task)


def of_current(task: Any) -> bool:
    """Whether ``task`` is a test of the calling session open here (its tests began, or
    only its opening ran: then its imports' effects are the session's own)."""
    return (
        task.target == TARGET
        and _current is not None
        and isinstance(task.kwargs, dict)
        and task.kwargs.get("session") == _current.key
    )


def step_aside() -> None:
    """Another kind of task (a ``cpq.run`` function, a launch) is about to run and reseed
    the generators: keep the current session's, for its next test here."""
    if _current is not None and _current.begun and _current.generators is None:
        _current.generators = generators.states()


def _not_collected(current: RankSession, nodeid: str, why: str) -> ItemRun:
    from _pytest.reports import TestReport

    report = TestReport(nodeid, (nodeid, None, nodeid), {}, "failed", why, "setup")
    data = current.config.hook.pytest_report_to_serializable(config=current.config, report=report)
    return ItemRun("failed", [data], [], ("CollectError", why.partition("\n")[0], why))


def _item_run(current: RankSession, rank: int) -> ItemRun:
    recorder = current.recorder
    config = current.config
    reports = [
        travel.report(config.hook.pytest_report_to_serializable(config=config, report=r))
        for r in recorder.reports
    ]
    failed = [r for r in recorder.reports if r.failed]
    if failed:
        outcome = "failed"
        kind = type(recorder.failure).__name__ if recorder.failure is not None else "Failed"
        text = failed[0].longreprtext
        crash = getattr(failed[0].longrepr, "reprcrash", None)
        line = crash.message if crash is not None else text.strip().partition("\n")[0]
        error: tuple[str, str, str] | None = (kind, line, text[-8000:])
    elif any(r.skipped for r in recorder.reports if r.when != "teardown"):
        outcome = "skipped"
        skipped = next(r for r in recorder.reports if r.skipped)
        reason = skipped.longrepr[2] if isinstance(skipped.longrepr, tuple) else "xfail"
        error = ("Skipped", str(reason), "")
    else:
        outcome, error = "passed", None
    return ItemRun(outcome, reports, recorder.warnings, error, recorder.failure)
