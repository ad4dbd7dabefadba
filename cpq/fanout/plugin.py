"""The pytest side of CI fan-out: keep this shard's share, record what ran, write results.

Why deselect in ``pytest_collection_modifyitems`` (last, after ``-k``/``-m``): under xdist
the controller does not collect, every worker does, and xdist insists that all workers end
with the same items. A pure function of the collected ids and the durations file
(:func:`cpq.fanout.shard.partition`) gives every worker, and every shard on every node,
the same answer without talking to anyone. Deselected tests go through
``pytest_deselected`` so pytest reports them as such.

Results (manifest and JUnit, see :mod:`cpq.fanout.manifest`) are written by the process
that sees every report: the session itself, or the xdist controller (from reports, plus
the collection its workers hand back). They are written only when sharding is on or
``--cpq-results`` is given, so plain runs leave no files behind.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cpq.fanout import durations, junit
from cpq.fanout.manifest import Manifest, TestRecord, stem
from cpq.fanout.shard import (
    SPAWN_PREFIX,
    ShardError,
    ShardSpec,
    TestInfo,
    digest,
    parse_shard,
    partition,
    shard_from_env,
    spec_label,
)

WORKER_KEY = "cpq_fanout"
DETAILS_LIMIT = 20_000


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("cpq")
    group.addoption(
        "--cpq-shard",
        default=None,
        metavar="I/N",
        help="run shard I of N (0-based; CPQ_SHARD, Slurm array and JOB_COMPLETION_INDEX "
        "variables are read when set; 'off' ignores them)",
    )
    group.addoption(
        "--cpq-durations",
        default=None,
        metavar="PATH",
        help="recorded seconds per test, the input of shard balancing "
        "(default .cpq/durations.json under the rootdir)",
    )
    group.addoption(
        "--cpq-results",
        default=None,
        metavar="DIR",
        help="write this shard's manifest and JUnit XML here (default .cpq/results/ under "
        "the rootdir when sharding)",
    )
    group.addoption(
        "--cpq-write-durations",
        action="store_true",
        default=False,
        help="update the durations file with this session's test walls at the end",
    )


def _spec(item: pytest.Item) -> str | None:
    """The pool spec label a marker test needs (None: unmarked, no spawn cost)."""
    marker = item.get_closest_marker("cpq")
    if marker is None:
        return None
    world_size = marker.kwargs.get("world_size", marker.args[0] if marker.args else 2)
    env = marker.kwargs.get("env") or {}
    return spec_label(world_size, env if isinstance(env, dict) else {})


def _record(records: dict[str, TestRecord], report: pytest.TestReport) -> None:
    """Fold one phase's report into the test's record."""
    record = records.setdefault(report.nodeid, TestRecord(outcome="passed", wall_s=0.0))
    record.wall_s += report.duration
    record.retries += report.capstderr.count("[CPQ-RETRY]")
    if report.failed:
        record.outcome = "failed" if report.when == "call" else "error"
        crash = getattr(report.longrepr, "reprcrash", None)
        text = report.longreprtext
        last = (text.strip().splitlines() or [""])[-1]
        record.message = str(getattr(crash, "message", "") or last)
        record.details = text[-DETAILS_LIMIT:]
    elif report.skipped and record.outcome == "passed":
        record.outcome = "skipped"
        longrepr = report.longrepr
        record.message = str(longrepr[2]) if isinstance(longrepr, tuple) else "skipped"


class FanoutPlugin:
    """Registered by ``cpq.client.plugin`` as ``cpq-fanout`` in every pytest process."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started_at = time.time()
        self.t0 = time.monotonic()
        self.is_worker = hasattr(config, "workerinput")
        option = config.getoption("cpq_shard")
        try:
            if option is not None and option.strip().lower() == "off":
                self.shard: ShardSpec | None = None
            elif option is not None:
                self.shard = parse_shard(option)
            else:
                self.shard = shard_from_env(os.environ)
        except ShardError as exc:
            raise pytest.UsageError(f"cpq: {exc}") from None
        here = config.invocation_params.dir
        raw = config.getoption("cpq_durations")
        self.durations_path = here / raw if raw else config.rootpath / durations.DEFAULT_PATH
        raw = config.getoption("cpq_results")
        self.results: Path | None = None
        if raw:
            self.results = here / raw
        elif self.shard is not None:
            self.results = config.rootpath / ".cpq" / "results"
        self.write_durations = bool(config.getoption("cpq_write_durations"))
        self.manifest: Manifest | None = None
        self.records: dict[str, TestRecord] = {}
        self.specs: dict[str, str] = {}
        self.recorded: dict[str, float] = {}  # the durations file the partition read
        self.groups_started: Callable[[], int] = lambda: 0  # set by register()

    @property
    def active(self) -> bool:
        return self.shard is not None or self.results is not None or self.write_durations

    # ----------------------------------------------------------------- collection

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        if not self.active:
            return
        tests = [TestInfo(item.nodeid, _spec(item)) for item in items]
        self.specs = {t.test_id: t.spec for t in tests if t.spec is not None}
        collected = [t.test_id for t in tests]
        index, count = (self.shard.index, self.shard.count) if self.shard else (0, 1)
        try:
            recorded = durations.load(self.durations_path)
        except durations.DurationsError as exc:
            raise pytest.UsageError(f"cpq: {exc}") from None
        self.recorded = recorded
        shards = partition(tests, count, recorded) if self.shard else [collected]
        keep = set(shards[index])
        deselected = [item for item in items if item.nodeid not in keep]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item.nodeid in keep]
        self.manifest = Manifest(
            index=index,
            count=count,
            collection_hash=digest(sorted(collected)),
            partition_hash=digest([sorted(s) for s in shards]),
            collected=collected,
            selected=shards[index],
            source=self.shard.source if self.shard else "--cpq-results",
            hostname=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            started_at=self.started_at,
        )
        workeroutput = getattr(config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput[WORKER_KEY] = self.manifest.to_json() | {"specs": self.specs}
        if self.results is not None and getattr(config, "workerinput", {}).get(
            "workerid", "gw0"
        ) in ("gw0",):
            self.manifest.write(self.results)  # complete: false, until the session ends

    def adopt(self, data: dict[str, Any]) -> None:
        """The xdist controller takes the collection a worker computed."""
        if self.manifest is not None:
            return
        from cpq.fanout.manifest import from_json

        self.specs = dict(data.pop("specs", {}))
        self.manifest = from_json(data, "xdist worker")

    # ----------------------------------------------------------------- reports

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.active and not self.is_worker:
            _record(self.records, report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.active or self.is_worker or self.manifest is None:
            return
        manifest = self.manifest
        selected = set(manifest.selected)
        manifest.tests = {i: r for i, r in self.records.items() if i in selected}
        manifest.wall_s = round(time.monotonic() - self.t0, 3)
        manifest.exitstatus = int(exitstatus)
        manifest.spawns, manifest.spawn_s, manifest.spawn_tests = self._spawns()
        manifest.complete = True
        if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and manifest.collected:
            session.exitstatus = pytest.ExitCode.OK  # more shards than tests: an empty share
        if self.results is not None:
            manifest.write(self.results)
            junit.write(self.results / f"{stem(manifest.index, manifest.count)}.xml", [manifest])
            self._export_timeline(manifest, self.results)
        if self.write_durations:
            walls = manifest.durations()
            walls |= {SPAWN_PREFIX + k: v for k, v in manifest.spawn_s.items()}
            try:
                durations.update(self.durations_path, walls)
            except (OSError, durations.DurationsError) as exc:
                session.config.issue_config_time_warning(
                    pytest.PytestWarning(f"cpq: could not write durations: {exc}"), stacklevel=2
                )

    def _export_timeline(self, manifest: Manifest, results: Path) -> None:
        """This node's timeline since the session started, beside the manifest, for ``cpq
        merge --trace/--timeline`` (nothing when the broker keeps no history here)."""
        from cpq import paths
        from cpq.timeline.command import export_shard
        from cpq.timings import TIMINGS_FILE

        out = results / f"{stem(manifest.index, manifest.count)}.timeline.jsonl"
        ran = sum(1 for test_id in manifest.tests if test_id in self.specs)
        try:
            export_shard(out, paths.state_dir() / TIMINGS_FILE, manifest.started_at, ran, 2.0)
        except OSError as exc:
            self.config.issue_config_time_warning(
                pytest.PytestWarning(f"cpq: could not export the timeline: {exc}"), stacklevel=2
            )

    def _spawns(self) -> tuple[int, dict[str, float], dict[str, str]]:
        """Groups this session ran on, and per spec the seconds its first test waited.

        The first test of a spec in a session waits for that spec's group (the spawn not
        hidden behind collection, plus the first-call warm-up): its wall minus the median
        wall of the spec's other tests is the spec's spawn cost as this shard paid it, and
        comes out of that test's recorded duration (:meth:`Manifest.durations`), so the
        next partition counts it once per shard and not as part of one test. The test's own
        seconds are taken from the durations file when it has them (else that median).
        """
        walls: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for test_id, record in self.records.items():  # in the order they ran
            label = self.specs.get(test_id)
            if label is not None and record.outcome in ("passed", "failed"):
                walls[label].append((test_id, record.wall_s))
        spawn_s: dict[str, float] = {}
        spawn_tests: dict[str, str] = {}
        for label, runs in walls.items():
            first, wall = runs[0]
            if first in self.recorded or len(runs) >= 2:
                own = self.recorded.get(first) or statistics.median(w for _, w in runs[1:])
                spawn_s[label] = round(max(0.0, wall - own), 3)
                spawn_tests[label] = first
        groups = self.groups_started()
        return groups, spawn_s, spawn_tests

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        manifest = self.manifest
        if manifest is None or self.is_worker:
            return
        where = f"; results in {self.results}" if self.results is not None else ""
        terminalreporter.write_sep(
            "-",
            f"cpq fan-out: shard {manifest.index}/{manifest.count} ran "
            f"{len(manifest.selected)} of {len(manifest.collected)} tests{where}",
        )


class FanoutXdistController:
    """Hands each xdist worker's collection to the controller's :class:`FanoutPlugin`."""

    def __init__(self, plugin: FanoutPlugin) -> None:
        self.plugin = plugin

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        data = getattr(node, "workeroutput", {}).get(WORKER_KEY)
        if isinstance(data, dict):
            self.plugin.adopt(dict(data))


def register(config: pytest.Config, groups_started: Callable[[], int]) -> None:
    """Register the fan-out plugin (and its xdist helper) on ``config``.

    ``groups_started`` is the cpq plugin's own count of the groups this session's tests ran
    on: handed in by the plugin that registers this one, so the fan-out imports nothing of
    the client side (docs/design.md "Module map").
    """
    plugin = FanoutPlugin(config)
    plugin.groups_started = groups_started
    config.pluginmanager.register(plugin, "cpq-fanout")
    xdist = any(config.pluginmanager.hasplugin(n) for n in ("xdist", "xdist.plugin"))
    if xdist and not plugin.is_worker:
        config.pluginmanager.register(FanoutXdistController(plugin), "cpq-fanout-xdist")
