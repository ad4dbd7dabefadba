"""The pytest plugin: ``@pytest.mark.cpq(world_size=2)``, ``--cpq-world-size N`` and the
``cpq`` fixture.

A test that runs on the ranks runs there through pytest itself, as under ``torchrun
--nproc-per-node N -m pytest``: every rank of a warm group runs the test's whole protocol
(fixtures of every scope, class setup, warning filters, capture) in a pytest session made
from this one's configuration, and this process hands pytest the ranks' combined reports
(:mod:`cpq.client.items`). Porting a suite written for ``torchrun -m pytest`` is one option,
``--cpq-world-size N``; a marker sets one test's world size.

The plugin is a client of one broker per node: every pytest session and every xdist worker
talks to the same broker, which starts (once, under a file lock) when the first such test
needs it. After collection the plugin tells the broker which specs the selected tests need,
so groups start while the first tests are being set up. Under a launcher (pytest itself
started by torchrun) the plugin steps aside: every test runs in this process, as asked.

Configuration, strongest first: command-line option, ``CPQ_*`` variable, ini option.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Generator, Hashable
from typing import Any

import pytest

from cpq import paths, protocol
from cpq.client import (
    confirm,
    early_warm,
    handoff,
    items,
    launches,
    opening,
    ordering,
    pdb_relay,
    reruns,
    timeouts,
)
from cpq.client.items import Unusable
from cpq.client.report import (
    SKIP_LOCATION_KEY,
    CpqTaskFailed,
    ranks_repr,
    report_result,
)
from cpq.client.session import CpqSession
from cpq.fanout import plugin as fanout
from cpq.protocol import PoolSpec, TaskResult

SESSION_KEY = pytest.StashKey["CpqSession"]()
ROUTING_KEY = pytest.StashKey[launches.Routing]()
#: The test's call report gives its own time: the wait for a group was taken off.
OWN_TIME_KEY = pytest.StashKey[bool]()
#: Why cpq cannot run this test as asked (a bad marker, an unsupported pytest).
UNUSABLE_KEY = pytest.StashKey[str]()


# --------------------------------------------------------------------------- options


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cpq", "cpq: warm torchrun groups")
    group.addoption("--cpq-endpoint", default=None, help="broker endpoint (CPQ_ENDPOINT)")
    group.addoption(
        "--cpq-timeout", type=float, default=None, help="default per-test deadline, s (CPQ_TIMEOUT)"
    )
    group.addoption(
        "--cpq-own-groups",
        action="store_true",
        default=False,
        help="run cpq tests only on groups that served no other session (CPQ_OWN_GROUPS=1)",
    )
    group.addoption(
        "--no-cpq-autostart",
        action="store_true",
        default=False,
        help="never start a background broker (CPQ_AUTOSTART=0)",
    )
    parser.addini("cpq_endpoint", "broker endpoint", default="")
    parser.addini("cpq_timeout", "default per-test deadline in seconds", default="")
    parser.addini("cpq_autostart", "start a broker when none runs", type="bool", default=True)
    reruns.add_options(parser, group)
    items.add_options(parser, group)
    confirm.add_options(parser, group)
    launches.add_options(parser, group)
    ordering.add_options(parser, group)
    pdb_relay.add_options(group)
    parser.addini(
        "cpq_own_groups", "only groups that served no other session", type="bool", default=False
    )
    fanout.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cpq(world_size=2, timeout=None, env=None, own_groups=False): run the test body on "
        "every rank of a warm torchrun group (torch.distributed initialised)",
    )
    config.stash[SESSION_KEY] = CpqSession(config)
    if config.pluginmanager.hasplugin("timeout"):  # pytest-timeout: cpq times marker tests
        config.pluginmanager.register(timeouts, "cpq-timeouts")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistController(config), "cpq-xdist")
    config.pluginmanager.register(_RanksReports(), "cpq-ranks-reports")
    session = config.stash[SESSION_KEY]
    # --cpq-world-size: the ranks open the session while this process collects
    config.pluginmanager.register(opening.OpenAhead(session), "cpq-open-ahead")
    if launches.enabled(config) and not session.under_launcher:
        config.stash[ROUTING_KEY] = launches.Routing()  # torchrun launches go to cpq
    # CI fan-out: shards, results, durations (cpq.fanout)
    fanout.register(config, groups_started=lambda: len(session.stats.groups))


def pytest_unconfigure(config: pytest.Config) -> None:
    handoff.at_end(config)
    routing = config.stash.get(ROUTING_KEY, None)
    if routing is not None:
        routing.close()
    session = config.stash.get(SESSION_KEY, None)
    if session is not None:
        session.close()


# --------------------------------------------------------------------------- warm-up

WARM_CACHE_KEY = early_warm.WARM_CACHE_KEY


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Hand the session to the project's warm caller (``handoff``: this process then only
    waits for it), else ask for the last session's groups before the conftests import
    (``early_warm``)."""
    handoff.at_start(early_config)
    early_warm.send(early_config)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Warm what the previous session of this project needed, before collection even starts.

    Collecting a suite that imports torch takes seconds; starting the groups the last run
    needed (remembered in pytest's cache) overlaps the spawn with that. The warm-up after
    collection then corrects for what this run actually selected. The same request went out
    before the conftests imported (``early_warm``) where it could; warming starts a spec's
    groups up to the count asked for, so asking again starts only what that did not.
    """
    handoff.at_session_start(session.config)
    cache = getattr(session.config, "cache", None)
    cpq_session = session.config.stash[SESSION_KEY]
    pdb_relay.wrap_pdb_invoke(session.config)  # after pytest's --pdb plugin is configured
    if early_warm.runs_no_test(session.config.option) or fanout.deselects(session.config):
        return  # nothing will run, or a shard: the last run's groups may be another share's
    if cache is None or not cpq_session.broker_at_hand():
        return
    here = cpq_session.spec(1, None)  # this shell's interpreter and start variables
    specs, counts = early_warm.cached_specs(cache.get(WARM_CACHE_KEY, None), here)
    if specs:
        cpq_session.warm(specs, counts)


_marker_args = items.marker_args


def _pool_args(item: pytest.Item) -> tuple[int, float | None, dict[str, str] | None] | None:
    """The pool a test needs, for warming: its marker's (the fixture style's too), else the
    session's ``--cpq-world-size`` for a test that runs on the ranks; None: none."""
    session = item.config.stash[SESSION_KEY]
    if session.under_launcher:
        return None
    marker = _marker_args(item)
    if marker is not None or session.world_size is None:
        return marker
    return None if "cpq" in getattr(item, "fixturenames", ()) else (session.world_size, None, None)


def _own_groups(item: pytest.Item) -> bool:
    marker = item.get_closest_marker("cpq")
    return bool(marker is not None and marker.kwargs.get("own_groups"))


def default_affinity(nodeid: str) -> str:
    """A test's affinity key: its function's node id without the parametrisation, so every
    case of one parametrised test prefers the group whose kernels it warmed."""
    name = nodeid.rpartition("::")[2]
    return nodeid[: len(nodeid) - len(name)] + name.partition("[")[0]


def _affinity(item: pytest.Item) -> str:
    """The marker's ``affinity=``, else :func:`default_affinity`."""
    marker = item.get_closest_marker("cpq")
    key = marker.kwargs.get("affinity") if marker is not None else None
    return str(key) if key is not None else default_affinity(item.nodeid)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Start a spec's group the moment its first test is collected: the spawn then overlaps
    the rest of collection (a suite importing torch and its helpers collects for seconds).
    A session whose cache already warmed the spec sends nothing; the warm-up after
    collection asks for as many groups as the selection can use."""
    if early_warm.runs_no_test(item.config.option) or _may_deselect(item.config):
        return  # the warm-up after collection knows what was selected
    cpq_session = item.config.stash.get(SESSION_KEY, None)
    try:
        args = _pool_args(item)
    except Unusable:
        return  # the test fails with the reason when it runs
    if cpq_session is None or args is None:
        return
    # Once per marker, not per collected case: building a spec reads the whole environment,
    # and a parametrised suite collects thousands of cases of a few markers.
    try:
        key = (args[0], tuple(sorted((args[2] or {}).items())))
    except TypeError:  # a bad env= in the marker: reported when the test runs
        return
    if key in cpq_session.warm_tried:
        return
    cpq_session.warm_tried.add(key)
    try:
        spec = cpq_session.spec(args[0], args[2])
    except ValueError:  # a bad env= in the marker: reported when the test runs
        return
    if spec in cpq_session.warmed:
        return
    if not cpq_session.broker_at_hand():
        return  # no broker to ask, and none to start: do not wait for one per spec
    cpq_session.warm([spec], [1])


def _may_deselect(config: pytest.Config) -> bool:
    """Whether options may drop collected tests (``-k``, ``-m``, ``--deselect``, ``--lf``,
    ``--sw``, a CI fan-out shard): a test collected is then not yet a test that runs, and
    warming its group could start a broker and take GPUs for nothing."""
    option = config.option
    return bool(
        fanout.deselects(config)
        or getattr(option, "keyword", "")
        or getattr(option, "markexpr", "")
        or getattr(option, "deselect", None)
        or getattr(option, "lf", False)
        or getattr(option, "stepwise", False)
    )


@pytest.hookimpl(trylast=True)  # after any plugin that reorders (pytest-randomly)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run a session's tests grouped by the spec they need (:mod:`cpq.client.ordering`)."""
    if config.stash[SESSION_KEY].under_launcher or ordering.keep_order(config):
        return

    def spec_of(item: pytest.Item) -> Hashable:
        try:
            args = _pool_args(item)
            return None if args is None else (args[0], tuple(sorted((args[2] or {}).items())))
        except Unusable:
            return None  # a bad marker: the test fails with the reason when it runs

    items[:] = ordering.grouped(items, spec_of)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the groups the selected tests need while the first tests are being set up."""
    if early_warm.runs_no_test(session.config.option):
        return  # nothing will run: start nothing
    cpq_session = session.config.stash[SESSION_KEY]
    cpq_session.rng_at_start.observe()  # numpy, imported by the test modules (cpq.rng)
    needed: Counter[PoolSpec] = Counter()
    for item in session.items:
        try:
            args = _pool_args(item)
        except Unusable:
            continue  # the test fails with the reason when it runs
        if args is not None:
            needed[cpq_session.spec(args[0], args[2])] += 1
    if not needed:
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    specs = list(needed)
    counts = [min(needed[s], workers) for s in specs]
    cache = getattr(session.config, "cache", None)
    if cache is not None:
        cache.set(
            WARM_CACHE_KEY,
            [{"spec": protocol.to_wire(s), "count": c} for s, c in zip(specs, counts, strict=True)],
        )
    cpq_session.warm(specs, counts)


def pytest_report_header(config: pytest.Config) -> list[str]:
    from cpq.client.autostart import broker_alive, code_difference, code_fingerprint

    session = config.stash[SESSION_KEY]
    if session.under_launcher:
        return [
            f"cpq: pytest runs under a launcher (RANK={os.environ.get('RANK')}): cpq steps "
            "aside, every test runs in this process"
        ]
    try:
        endpoint = session.resolved_endpoint()
    except paths.UnsafeStateDir as exc:
        return [f"cpq: {exc}"]
    if endpoint.startswith("ipc://") and not broker_alive(endpoint):
        if session.autostart:  # not an error: said so (a newcomer read "no broker" as one)
            return [f"cpq: broker {endpoint}: not running yet, starts when a cpq test runs"]
        return [f"cpq: no broker at {endpoint} (autostart is off)"]
    try:
        status = session.status_if_connected()
    except Exception as exc:
        return [f"cpq: broker at {endpoint} not answering: {exc}"]
    if status is None:
        return [f"cpq: no broker at {endpoint}"]
    broker = status["broker"]
    groups = Counter(f"{p['spec']}[{_state(p, session.process_session)}]" for p in status["pools"])
    listing = ", ".join(f"{k}x{v}" for k, v in sorted(groups.items())) or "none yet"
    lines = [
        f"cpq: broker {endpoint} pid {broker['pid']} GPUs {','.join(broker['gpus']) or 'none'}; "
        f"groups: {listing}"
    ]
    if broker.get("code", code_fingerprint()) != code_fingerprint():
        lines.append(
            f"cpq: that broker runs other cpq code than this session ({code_difference(broker)}); "
            "`cpq stop` it to use this code"
        )
    return lines


def _state(pool: dict[str, Any], session_id: str) -> str:
    """A group's state for the header. A group busy with this session's own task (its
    opening, which starts before the header is written) says so: a newcomer read a bare
    "busy" as another session holding the group."""
    task = pool.get("task") or {}
    if pool["state"] == "busy" and task.get("session") == session_id:
        return "busy: this session"
    return str(pool["state"])


# --------------------------------------------------------------------------- running


def placement(item: pytest.Item) -> items.Placement | None:
    """Where ``item`` runs: on the ranks (its marker's world size, else ``--cpq-world-size``'s),
    or here (None): a test that uses the ``cpq`` fixture calls ``cpq.run`` itself, and under a
    launcher (pytest started by torchrun) every test runs in this process."""
    session = item.config.stash[SESSION_KEY]
    if session.under_launcher or "cpq" in getattr(item, "fixturenames", ()):
        return None
    marker = _marker_args(item)
    world_size = marker[0] if marker is not None else session.world_size
    if world_size is None:
        return None
    items.check_pytest()
    return items.Placement(*marker) if marker is not None else items.Placement(world_size)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, Any, Any]:
    """A test that runs on the ranks walks pytest's protocol here with hollow phases
    (:mod:`cpq.client.items`): every plugin of this process sees it as a local test."""
    try:
        where = placement(item)
    except Unusable as exc:  # fails in its setup (pytest_runtest_setup), runs nothing
        item.stash[UNUSABLE_KEY] = str(exc)
        return (yield)
    if where is None:
        return (yield)
    session = item.config.stash[SESSION_KEY]
    key, setup = items.rank_setup(item.config, session.session_id)

    last: list[TaskResult] = []

    def submit(kwargs: dict[str, Any], fresh_group: bool = False) -> TaskResult:
        left = timeouts.remaining(item)  # under pytest-timeout: what is left of it
        if fresh_group and last and last[-1].debug_rank >= 0:
            session.client.debug_release(last[-1].task_id)  # --pdb: the fresh run's instead
        last.append(_submit(kwargs, fresh_group, left))
        return last[-1]

    def _submit(kwargs: dict[str, Any], fresh_group: bool, left: float | None) -> TaskResult:
        # the session's first test goes to the group that opened it (cpq.client.opening)
        opened = (
            ""
            if fresh_group
            else opening.wait(item.config, session, key, item.nodeid, where.world_size, where.env)
        )
        return session.submit(
            items.TARGET,
            where.world_size,
            kwargs,
            left if left is not None else where.timeout,
            where.env,
            item.nodeid,
            opened or _affinity(item),
            retries=reruns.retries_for(item, session.retries, timed=left is not None),
            debug=True,
            own_groups=_own_groups(item),
            send_rng=False,  # the ranks' own plugins and fixtures seed them
            fresh_group=fresh_group,
        )

    def debugger(result: TaskResult) -> None:
        pdb_relay.remember(item, session.client, result.task_id)

    items.prepare(item, where, nextitem, key, setup, submit, debugger)
    try:
        return (yield)
    finally:
        items.restore(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    unusable = item.stash.get(UNUSABLE_KEY, None)
    if unusable is not None:  # before any fixture: the test fails naming the problem
        pytest.fail(f"{item.nodeid}: {unusable}", pytrace=False)
    if ROUTING_KEY in item.config.stash:  # torch.distributed.run.run(args) here goes warm
        launches.route_in_process()


def pytest_runtest_teardown(item: pytest.Item) -> None:
    pdb_relay.release_pending(item)  # a post-mortem pytest did not open (an xfail, say)


class _RanksReports:
    """Hands pytest the ranks' report of a phase before its own ``makereport`` runs.

    pytest's own builds a report from the hollow phase's exception (:mod:`cpq.client.items`
    raises what the ranks' phase ended in) and renders its traceback, through pytest's runner
    and cpq's frames, with the source of each: 20-80 ms a failing test, only for the wrapper
    below to replace it with the ranks' report. Measured in the calling process of a 300-test
    suite (BENCHMARKS.md, "Where the warm session's wall goes"). None: pytest's own runs
    (a test of this process, or a verdict without reports of the ranks).
    """

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> pytest.TestReport | None:
        return items.phase_report(item, call.when)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, Any]:
    report = yield
    ranks = items.phase_report(item, call.when)  # the ranks' own, when pytest ran it there
    if ranks is not None:
        report = ranks
    elif call.excinfo is not None and isinstance(call.excinfo.value, CpqTaskFailed):
        report.longrepr = ranks_repr(call.excinfo.value, str(item.path))  # no reports of theirs
    if ranks is None and (hollow := items.hollow_duration(item, call.when)) is not None:
        report.duration = hollow  # --durations and JUnit: the test's time, not the wait
    session = item.config.stash[SESSION_KEY]
    routing = item.config.stash.get(ROUTING_KEY, None)
    if routing is not None:  # the waits of the torchrun launches the test made
        session.stats.spawn_wait_s += routing.fold(session.spawn_waits, session.stats.groups)
    waits = session.spawn_waits
    if call.when == "call" and ranks is None and item.nodeid in waits:
        # A body that called cpq.run waited for a group inside its call: --durations, JUnit
        # and the fan-out's slowest list give its own time; the wait is reported apart.
        report.duration = max(0.0, report.duration - waits[item.nodeid])
        item.stash[OWN_TIME_KEY] = True
    waited = waits.pop(item.nodeid, None) if call.when == "teardown" else None
    # Travels with the report (xdist too) to cpq.fanout's records, and to JUnit: the wait
    # for a group where there was one; both only where the fan-out keeps records (a fresh
    # run's JUnit file has no properties, and a strict xunit2 reader refuses them).
    keeps = waited is not None and fanout.records(item.config)
    if waited is not None and (keeps or waited > 0):
        report.user_properties.append((fanout.SPAWN_WAIT_PROPERTY, round(waited, 4)))
    if keeps and (ranks is not None or item.stash.get(OWN_TIME_KEY, False)):
        report.user_properties.append((fanout.RANK_TIME_PROPERTY, True))  # no wait in durations
    if call.when != "setup" or report.failed:
        confirm.attach(item, report)  # the deciding phase and the teardown carry it
    location = item.stash.get(SKIP_LOCATION_KEY, None)
    if location is not None and report.skipped and isinstance(report.longrepr, tuple):
        report.longrepr = (location[0], location[1], report.longrepr[2])  # the body's skip
    return report


def pytest_report_teststatus(
    report: pytest.TestReport, config: pytest.Config
) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
    return confirm.teststatus(report)  # -v: "PASSED (failed warm, passed on a fresh group)"


# --------------------------------------------------------------------------- fixture


class CpqRunner:
    """The ``cpq`` fixture: ``cpq.run("module:function", world_size=2, **kwargs)``.

    A ``cpq`` marker on a test that uses this fixture does not send the body anywhere: it
    declares the pool the test's ``cpq.run`` calls use (world size, env, timeout become
    their defaults), so the plugin can warm that pool during collection.
    """

    def __init__(self, item: pytest.Item, session: CpqSession) -> None:
        self._item = item
        self._session = session
        try:
            self._defaults = _marker_args(item) or (2, None, None)
        except Unusable as exc:
            pytest.fail(f"{item.nodeid}: {exc}", pytrace=False)

    def run(
        self,
        target: str,
        world_size: int | None = None,
        *,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> TaskResult:
        """Run ``target(**kwargs)`` on every rank; fail or skip this test like a local call."""
        world_size = world_size if world_size is not None else self._defaults[0]
        timeout = timeout if timeout is not None else self._defaults[1]
        env = env if env is not None else self._defaults[2]

        def submit(fresh_group: bool = False) -> TaskResult:
            return self._session.submit(
                target,
                world_size,
                kwargs,
                timeout,
                env,
                self._item.nodeid,
                _affinity(self._item),
                retries=reruns.retries_for(self._item, self._session.retries, timed=False),
                own_groups=_own_groups(self._item),
                fresh_group=fresh_group,
            )

        try:
            result = submit()
            if confirm.wanted(self._item.config, result, result.outcome == "failed"):
                failures = [r.error.traceback for r in result.failed_ranks if r.error]
                warm = confirm.warm_text(result, failures)
                result = submit(fresh_group=True)  # the verdict is the fresh run's
                confirm.note(self._item, result.outcome in ("failed", "error"), warm)
        except protocol.EncodeError as exc:
            pytest.fail(str(exc), pytrace=False)
        report_result(self._item, result, target)
        return result


@pytest.fixture
def cpq(request: pytest.FixtureRequest) -> CpqRunner:
    return CpqRunner(request.node, request.config.stash[SESSION_KEY])


# --------------------------------------------------------------------------- summary


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the stats to the controller
        workeroutput["cpq"] = session.config.stash[SESSION_KEY].stats.to_wire()
        workeroutput[confirm.WORKER_KEY] = confirm.to_wire(session.config)


class _XdistController:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", {})
        data = output.get("cpq")
        if data:
            self.config.stash[SESSION_KEY].stats.merge(data)
        confirm.merge(self.config, output.get(confirm.WORKER_KEY))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    session = config.stash[SESSION_KEY]
    stats = session.stats
    if not stats.tasks or config.get_verbosity() <= -2:
        return  # -qq: pytest's own summary only
    retries = f"{stats.retries} retr{'y' if stats.retries == 1 else 'ies'}"
    line = f"cpq: {stats.tasks} task(s) on {len(stats.groups)} group(s), {retries}"
    line += f"; {stats.spawn_wait_s:.1f}s waiting for groups to start (measured by the broker)"
    if handoff.served():
        line += "; started from the project's warm caller"
    elif refused := handoff.refused():
        line += f"; not started from the project's warm caller: {refused}"
    confirmed, tests = confirm.summary(config)
    terminalreporter.write_sep("-", line + confirmed)
    for test in tests:
        terminalreporter.write_line(test)


__all__ = ["CpqRunner", "CpqTaskFailed", "cpq"]
