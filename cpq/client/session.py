"""One pytest process's side of cpq: its client, its spec building, what it has run.

:class:`CpqSession` is what the plugin (:mod:`cpq.client.plugin`) keeps per pytest process
(in ``config.stash``): the connection to the broker (opened, and the broker autostarted,
only when a test needs it), the session id every xdist worker shares, the import roots the
tasks' specs carry, and :class:`Stats` — the tasks, groups and waits the terminal summary
reports, measured by the broker and merged over xdist workers.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest

from cpq import paths, rng
from cpq.client import coverage_relay, pdb_relay, reruns
from cpq.client.report import BrokerGone
from cpq.protocol import PoolSpec, TaskResult

#: How a draining broker answers a submit (``cpq.broker.tasks``).
DRAINING = "rejected: the broker is draining"


def session_id(config: pytest.Config) -> str:
    """One id for a pytest session and all its xdist workers: what ``cpq-status --trace
    --session last`` picks. A worker has its controller's ``testrunuid``; a controller
    that was given none sets the one xdist will hand its workers."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and workerinput.get("testrunuid"):
        return str(workerinput["testrunuid"])
    given = getattr(config.option, "testrunuid", None)
    if given:
        return str(given)
    sid = uuid.uuid4().hex
    if hasattr(config.option, "testrunuid"):
        config.option.testrunuid = sid
    return sid


@dataclass
class Stats:
    tasks: int = 0
    retries: int = 0
    errors: int = 0
    groups: set[str] = field(default_factory=set)
    #: Seconds tasks waited for groups to start, as the broker measured them.
    spawn_wait_s: float = 0.0

    def record(self, result: TaskResult) -> None:
        self.tasks += 1
        self.retries += result.attempts - 1
        self.errors += result.outcome == "error"
        self.groups.update(result.groups or ([result.group_id] if result.group_id else []))
        self.spawn_wait_s += result.spawn_wait_s or 0.0

    def to_wire(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "retries": self.retries,
            "errors": self.errors,
            "groups": sorted(self.groups),
            "spawn_wait_s": self.spawn_wait_s,
        }

    def merge(self, data: dict[str, Any]) -> None:
        self.tasks += data["tasks"]
        self.retries += data["retries"]
        self.errors += data["errors"]
        self.groups.update(data["groups"])
        self.spawn_wait_s += float(data.get("spawn_wait_s", 0.0))


def _endpoint_given(config: pytest.Config, options: Any = None) -> str | None:
    """The broker endpoint the user named: option, ``CPQ_ENDPOINT``, ini; None: none.
    ``options``: where the options are read (``config.option``; before the conftests load,
    ``config.known_args_namespace``)."""
    options = config.option if options is None else options
    return (
        getattr(options, "cpq_endpoint", None)
        or os.environ.get(paths.ENDPOINT_VAR)
        or config.getini("cpq_endpoint")
        or None
    )


def endpoint_of(config: pytest.Config, options: Any = None) -> str:
    """The broker endpoint this session talks to (the default one when none is named)."""
    return _endpoint_given(config, options) or paths.default_endpoint()


def autostart_of(config: pytest.Config, options: Any = None) -> bool:
    """Whether this session may start a background broker (option, ``CPQ_AUTOSTART``, ini)."""
    options = config.option if options is None else options
    env_autostart = os.environ.get("CPQ_AUTOSTART")
    return not getattr(options, "no_cpq_autostart", False) and (
        env_autostart != "0" if env_autostart is not None else bool(config.getini("cpq_autostart"))
    )


def roots_of(config: pytest.Config) -> list[str]:
    """A spec's import roots for this session: rootdir and ``PYTHONPATH``, as ``cpq submit``
    run from the rootdir would send, so the shell and the test suite share warm groups."""
    roots = [str(config.rootpath)]
    roots += [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return list(dict.fromkeys(roots))


def spec_of(config: pytest.Config, world_size: int) -> PoolSpec:
    """The spec this process would ask for at ``world_size`` with its variables now."""
    from cpq.specs import make_spec

    return make_spec(world_size, None, roots_of(config))


class CpqSession:
    """This pytest process's connection to the broker (opened on first need)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.session_id = session_id(config)
        self.endpoint = _endpoint_given(config)
        timeout = (
            config.getoption("cpq_timeout")
            or os.environ.get(paths.TIMEOUT_VAR)
            or config.getini("cpq_timeout")
        )
        self.timeout = float(timeout) if timeout else paths.DEFAULT_TIMEOUT_S
        self.autostart = autostart_of(config)
        self.retries = reruns.configured(config)
        self.debug_rank = pdb_relay.debug_rank(config)
        env_own = os.environ.get("CPQ_OWN_GROUPS")
        ini_own = bool(config.getini("cpq_own_groups"))
        self.own_groups = config.getoption("cpq_own_groups") or (
            env_own not in ("", "0") if env_own is not None else ini_own
        )
        #: This pytest process's part of the session (``Submit.session``): the session id,
        #: and an xdist worker's id after it. A worker is one pytest process, as in a fresh
        #: run: placement keeps its tests on its own group (docs/design.md "A session's
        #: home"). With the shared id, two workers measuring coverage took turns on one
        #: group, and each turn put back the torch switches the other's tests had set.
        workerinput = getattr(config, "workerinput", None) or {}
        worker = workerinput.get("workerid")
        self.process_session = f"{self.session_id}/{worker}" if worker else self.session_id
        #: The random state when the session began: a plugin set it when it differs now.
        self.rng_at_start = rng.Snapshot()
        self.stats = Stats()
        self._client: Any = None
        self._roots: list[str] | None = None
        self.started_broker = False
        self.warmed: dict[PoolSpec, int] = {}
        #: Markers (world size, env) whose group was asked for during collection, once each.
        self.warm_tried: set[tuple[int, tuple[tuple[str, str], ...]]] = set()
        #: Why the broker is gone, once it is: every later cpq test fails with this one line
        #: instead of a client traceback (a new broker is not started behind the user's back).
        self.broker_gone: str = ""
        #: Per test id, the spawn waits its tasks' verdicts carried (reported with the test).
        self.spawn_waits: dict[str, float] = {}
        from cpq.client.items import default_world_size

        #: ``--cpq-world-size``: every test runs on this many ranks (None: marker tests only).
        self.world_size = default_world_size(config)
        #: pytest itself runs under a launcher (torchrun set RANK): cpq steps aside and every
        #: test runs in this process, as asked.
        self.under_launcher = "RANK" in os.environ and (
            "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
        )

    def status_if_connected(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """The broker's status for reports, without starting (or waiting long for) a broker.

        The xdist controller never submits, so it has no client: it connects only when a
        broker is known to run, and never autostarts one just to print a summary.
        """
        from cpq.client.autostart import broker_alive

        if self._client is None:
            endpoint = self.resolved_endpoint()
            if endpoint.startswith("ipc://") and not broker_alive(endpoint):
                return None
            from cpq.client.api import Client

            self._client = Client(
                endpoint, name="pytest", connect_timeout_s=timeout_s, info=self.client_info
            )
        status: dict[str, Any] = self._client.status(timeout_s=timeout_s)
        return status

    def resolved_endpoint(self) -> str:
        return self.endpoint or paths.default_endpoint()

    def broker_at_hand(self) -> bool:
        """Whether asking the broker now is worth it: autostart may start one, or one runs
        (an endpoint that is not a local socket is taken to be up)."""
        if self.autostart:
            return True
        from cpq.client.autostart import broker_alive

        endpoint = self.resolved_endpoint()
        return not endpoint.startswith("ipc://") or broker_alive(endpoint)

    @property
    def client(self) -> Any:
        if self._client is None:
            from cpq.client.api import Client
            from cpq.client.autostart import ensure_broker

            endpoint = self.resolved_endpoint()
            if self.autostart and endpoint.startswith("ipc://"):
                self.started_broker = ensure_broker(endpoint)
            self._client = Client(endpoint, name="pytest", info=self.client_info)
        return self._client

    @property
    def client_info(self) -> dict[str, Any]:
        """What the broker's timeline says of this client: its pytest session."""
        return {"session": self.session_id}

    def roots(self) -> list[str]:
        """The spec's import roots: rootdir and PYTHONPATH, as ``cpq submit`` run from the
        rootdir would send, so the shell and the test suite share warm groups."""
        if self._roots is None:
            self._roots = roots_of(self.config)
        return self._roots

    @staticmethod
    def import_paths() -> list[str]:
        """The user's own sys.path entries (what pytest's import mode inserted for conftest
        and test directories; not the stdlib or site-packages). They travel with each test
        and are added to the rank's sys.path the way pytest adds them to its own."""
        skip = _library_paths()
        paths_ = []
        for entry in sys.path:
            path = os.path.abspath(entry or os.getcwd())
            if (
                path not in skip
                and "site-packages" not in path
                and "dist-packages" not in path
                and not path.startswith(sys.base_prefix + os.sep + "lib")
                and os.path.isdir(path)
            ):
                paths_.append(path)
        return list(dict.fromkeys(paths_))

    def warm(self, specs: list[PoolSpec], counts: list[int]) -> None:
        try:
            self.client.warm(specs, counts)
        except Exception as exc:  # warm-up is an optimisation; the tests will report problems
            self.config.issue_config_time_warning(
                pytest.PytestWarning(f"cpq: could not warm groups: {exc}"), stacklevel=2
            )
            return
        for spec, count in zip(specs, counts, strict=True):
            self.warmed[spec] = max(count, self.warmed.get(spec, 0))

    def spec(self, world_size: int, env: dict[str, str] | None) -> PoolSpec:
        from cpq.specs import make_spec

        return make_spec(world_size, env, self.roots())

    def submit(
        self,
        target: str,
        world_size: int,
        kwargs: dict[str, Any],
        timeout: float | None,
        env: dict[str, str] | None,
        test_id: str,
        affinity: str = "",
        retries: int | None = None,
        debug: bool = False,
        own_groups: bool = False,
        send_rng: bool = True,
        fresh_group: bool = False,
    ) -> TaskResult:
        from cpq.client.api import BrokerUnavailable

        notices = _Notices(self.config, test_id)
        if not self.broker_gone:
            cov = coverage_relay.current()
            context = f"{test_id}|run" if getattr(self.config.option, "cov_context", "") else ""
            try:
                result: TaskResult = self.client.submit(
                    target,
                    world_size,
                    kwargs,
                    timeout=timeout or self.timeout,
                    env=env,
                    test_id=test_id,
                    roots=self.roots(),
                    on_wait=notices.say,
                    affinity=affinity,
                    retries=self.retries if retries is None else retries,
                    debug_rank=self.debug_rank if debug else None,
                    rng=rng.capture() if send_rng and self.rng_at_start.changed() else None,
                    coverage=None if cov is None else coverage_relay.session_config(cov, context),
                    session=self.process_session,
                    # Measured: only groups whose imports this session measured (a module
                    # another session's task imported would lose its import-time lines).
                    own_groups=own_groups or self.own_groups or cov is not None,
                    fresh_group=fresh_group,
                )
            except BrokerUnavailable as exc:
                self.broker_gone = f"cpq: {exc}"
            else:
                notices.done()
                if cov is not None:
                    coverage_relay.merge(cov, result.coverage)
                self.stats.record(result)
                if result.spawn_wait_s is not None:  # None: a broker that did not measure it
                    waits = self.spawn_waits
                    waits[test_id] = waits.get(test_id, 0.0) + result.spawn_wait_s
                if result.outcome == "error" and result.message.startswith(DRAINING):
                    self.broker_gone = "cpq: the broker is draining (cpq drain): no new tests"
                else:
                    return result
        raise BrokerGone(self.broker_gone, pytrace=False)  # one line: the broker is gone

    def wait(self, future: Future[TaskResult], test_id: str) -> TaskResult:
        """A task sent ahead (:mod:`cpq.client.opening`), waited for on behalf of
        ``test_id``: the broker's word on a wait for a group is said as for the test's own."""
        notices = _Notices(self.config, test_id)
        result: TaskResult = self.client.wait(future, notices.say)
        notices.done()
        # The summary's wait for groups is the session's: "waiting for a ws2 group" said
        # here must show there (a newcomer's trial read "0.0s waiting" after it).
        self.stats.spawn_wait_s += result.spawn_wait_s or 0.0
        self.stats.groups.update(result.groups or ([result.group_id] if result.group_id else []))
        return result

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class _Notices:
    """The broker's word on why a test still waits for a group, shown as it happens: on the
    terminal (past pytest's capture), each on a line of its own, and in the test's captured
    stderr (JUnit's ``<system-err>``). pytest's progress line goes on after them as pytest
    writes it after any line of its own: the test file's name again, then the letters."""

    def __init__(self, config: pytest.Config, test_id: str) -> None:
        self.config = config
        self.test_id = test_id
        self.shown = False
        self.last = ""  # the broker repeats its word while the wait lasts: said once

    def say(self, notice: str) -> None:
        if notice != self.last:
            self.last = notice
            self._say(notice)

    def _terminal(self) -> tuple[Any, Any] | None:
        manager = self.config.pluginmanager
        reporter = manager.get_plugin("terminalreporter")
        capture = manager.get_plugin("capturemanager")
        if reporter is None or capture is None or hasattr(self.config, "workerinput"):
            return None  # an xdist worker has no terminal of its own: the stderr copy is shown
        return reporter, capture

    def _say(self, notice: str) -> None:
        line = f"cpq: {notice}"
        terminal = self._terminal()
        if terminal is not None:
            reporter, capture = terminal
            with capture.global_and_fixture_disabled():
                reporter.ensure_newline()  # ends a progress line pytest knows it is on
                writer = getattr(reporter, "_tw", None)
                if getattr(writer, "width_of_current_line", 0):  # -q: a line of letters
                    reporter.write("\n")
                reporter.write_line(line, yellow=True)
            self.shown = True
            if self.config.getoption("capture", "fd") == "no":
                return  # -s: stderr is this terminal, which has the line already
        sys.stderr.write(line + "\n")  # lands in the test's captured stderr (and JUnit)

    def done(self) -> None:
        """After the wait: the test's letter goes on a progress line that names its file, as
        pytest starts one (``tests/test_x.py ``) — not alone on a line after the notice."""
        terminal = self._terminal() if self.shown else None
        if terminal is None:
            return
        reporter, capture = terminal
        if not reporter.showfspath or reporter.showlongtestinfo or reporter.currentfspath:
            return  # -q writes letters only; -v writes the test's name again itself
        path = self.config.rootpath / self.test_id.split("::")[0]
        with capture.global_and_fixture_disabled():
            reporter.write(os.path.relpath(path, reporter.startpath) + " ")
        reporter.currentfspath = path


@functools.cache
def _library_paths() -> frozenset[str]:
    found = sysconfig.get_paths()
    return frozenset(found[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))
