"""The pytest side of CI fan-out: keep this shard's share, record what ran, write results.

Why deselect in ``pytest_collection_modifyitems`` (last, after ``-k``/``-m``): under xdist
the controller does not collect, every worker does, and xdist insists that all workers end
with the same items. A pure function of the collected ids and the durations file
(:func:`cpq.fanout.shard.partition`) gives every worker, and every shard on every node,
the same answer without talking to anyone. Deselected tests go through
``pytest_deselected`` so pytest reports them as such.

Results (manifest and JUnit, see :mod:`cpq.fanout.manifest`) are written by the process
that sees every report: the session itself, or the xdist controller (from reports, plus
the share the first worker wrote). They are written only when sharding is on or
``--cpq-results`` is given, so plain runs leave no files behind. The manifest is rewritten
as tests finish, at most every :data:`FLUSH_EVERY_S` (one atomic rename per batch, not per
test), so a shard cancelled mid-run still names what it ran.

Spawn costs are measured, not inferred: each verdict carries the seconds its task waited
for a group to start (the broker measures it, ``TaskResult.spawn_wait_s``); ``cpq.client.plugin``
hands it on with the test's report as the :data:`SPAWN_WAIT_PROPERTY` user property.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cpq.fanout import brokerargs, durations, junit, runid
from cpq.fanout.attempts import TimelineTail, carry_over, timeline_file
from cpq.fanout.manifest import Attempt, Manifest, ManifestError, TestRecord, own_files, read, stem
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
#: The user property (on a test's reports) with the seconds its tasks waited for a group.
SPAWN_WAIT_PROPERTY = "cpq_spawn_wait_s"
#: On a test the ranks ran through pytest: its reports' durations are the ranks' own time,
#: without the wait for a group (``TestRecord.wait_in_wall``).
RANK_TIME_PROPERTY = "cpq_rank_time"
#: Least seconds between two rewrites of the manifest while tests run.
FLUSH_EVERY_S = 1.0


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


def _suite_world_size(config: pytest.Config) -> int | None:
    """``--cpq-world-size`` / ``CPQ_WORLD_SIZE`` / ini ``cpq_world_size`` (the plugin checks
    the value; here a bad one only means no spawn cost is counted)."""
    value = config.getoption("cpq_world_size", None) or os.environ.get("CPQ_WORLD_SIZE")
    if value is None:
        try:
            value = config.getini("cpq_world_size")
        except ValueError:
            return None
    try:
        return int(value) if value else None
    except (TypeError, ValueError):
        return None


def _spec(item: pytest.Item) -> str | None:
    """The pool spec label a test needs: its marker's, else the suite's world size for a
    test that runs on the ranks (None: it runs in the pytest process, no spawn cost)."""
    marker = item.get_closest_marker("cpq")
    if marker is None:
        size = _suite_world_size(item.config)
        if size is None or "cpq" in getattr(item, "fixturenames", ()):
            return None
        return spec_label(size, {})
    world_size = marker.kwargs.get("world_size", marker.args[0] if marker.args else 2)
    env = marker.kwargs.get("env") or {}
    return spec_label(world_size, env if isinstance(env, dict) else {})


def _record(records: dict[str, TestRecord], report: pytest.TestReport) -> None:
    """Fold one phase's report into the test's record."""
    record = records.setdefault(report.nodeid, TestRecord(outcome="passed", wall_s=0.0))
    record.wall_s += report.duration
    record.retries += report.capstderr.count("[CPQ-RETRY]")
    for name, value in report.user_properties:
        if name == SPAWN_WAIT_PROPERTY and isinstance(value, int | float):
            record.spawn_wait_s = (record.spawn_wait_s or 0.0) + float(value)
        elif name == RANK_TIME_PROPERTY:
            record.wait_in_wall = False
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
        self.run_id, self.run_id_source = runid.from_env(os.environ)
        if not self.is_worker and self.active:
            os.environ[runid.RUN_ID_VAR] = self.run_id  # xdist workers start with this one
        self.flushed_at = 0.0
        self.manifest: Manifest | None = None
        self.records: dict[str, TestRecord] = {}
        self.specs: dict[str, str] = {}
        self.recorded: dict[str, float] = {}  # the durations file the partition read
        self.groups_started: Callable[[], int] = lambda: 0  # set by register()
        self.attempts: list[Attempt] = []  # this run's earlier attempts at this shard
        self.tail: TimelineTail | None = None

    @property
    def active(self) -> bool:
        return self.shard is not None or self.results is not None or self.write_durations

    def deselects(self) -> bool:
        """Whether this session keeps only part of what it collects (it is a shard)."""
        return self.shard is not None

    @pytest.hookimpl(tryfirst=True)  # before xdist starts workers that write the share
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """A shard clears its own earlier result files (an earlier run's, or its own before
        a requeue): until it writes again, the merge sees this shard as missing, never as
        the stale result of another run. What an earlier attempt of this run left is kept
        as an attempt (:mod:`cpq.fanout.attempts`)."""
        if self.results is None or self.is_worker:
            return
        index, count = (self.shard.index, self.shard.count) if self.shard else (0, 1)
        self.attempts = carry_over(self.results, index, count, self.run_id)

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
        if self.shard is not None:  # before the warm-up after collection autostarts it
            brokerargs.configure_spares(os.environ, [self.specs.get(i) for i in keep])
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
            run_id=self.run_id,
            source=self.shard.source if self.shard else "--cpq-results",
            hostname=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            started_at=self.started_at,
            attempts=list(self.attempts),
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
        from cpq.fanout.manifest import from_json

        self.specs = dict(data.pop("specs", {}))
        if self.manifest is None:
            self.manifest = from_json(data, "xdist worker")
            self.manifest.run_id = self.run_id
            self.manifest.attempts = list(self.attempts)  # the controller carried them

    def _share_from_disk(self) -> None:
        """Under xdist the controller collects nothing: it takes the share the first worker
        wrote (this run's, this shard's), so it can rewrite the manifest as tests finish."""
        if self.manifest is not None or self.results is None:
            return
        index, count = (self.shard.index, self.shard.count) if self.shard else (0, 1)
        try:
            found = read(own_files(self.results, index, count)[0])
        except ManifestError:
            return
        if found.run_id == self.run_id and not found.complete:
            self.manifest = found
            found.attempts = list(self.attempts)  # the controller carried them

    # ----------------------------------------------------------------- reports

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not self.active or self.is_worker:
            return
        _record(self.records, report)
        if report.when == "teardown" and self.results is not None:
            self._flush(force=False)

    def _flush(self, force: bool) -> None:
        """Rewrite the manifest with the tests finished so far (at most every
        :data:`FLUSH_EVERY_S` unless ``force``)."""
        now = time.monotonic()
        if not force and now - self.flushed_at < FLUSH_EVERY_S:
            return
        self._share_from_disk()
        if self.manifest is None or self.results is None:
            return
        self.flushed_at = now
        selected = set(self.manifest.selected)
        done = {i: r for i, r in self.records.items() if i in selected}
        self.manifest.tests = done
        self.manifest.spawn_s = self._spawn_costs()
        # What it took so far, so a shard killed before its end still shows its time:
        self.manifest.wall_s = round(now - self.t0, 3)
        self.manifest.spawns = self.groups_started()
        self.manifest.write(self.results)
        self._tail_timeline(self.manifest, self.results)

    def _tail_timeline(self, manifest: Manifest, results: Path) -> None:
        """Append the node's new timeline records to the shard's timeline file (the export
        at the session's end rewrites it whole): a killed shard keeps its picture."""
        if self.tail is None:
            from cpq import paths
            from cpq.timeline.records import timeline_path
            from cpq.timings import TIMINGS_FILE

            out = timeline_file(results, manifest.index, manifest.count)
            source = timeline_path(paths.state_dir() / TIMINGS_FILE)
            self.tail = TimelineTail(source, out, manifest.started_at)
        try:
            self.tail.flush()
        except OSError as exc:
            self.config.issue_config_time_warning(
                pytest.PytestWarning(f"cpq: could not append to the timeline: {exc}"),
                stacklevel=2,
            )

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.active or self.is_worker or self.manifest is None:
            return
        manifest = self.manifest
        selected = set(manifest.selected)
        manifest.tests = {i: r for i, r in self.records.items() if i in selected}
        manifest.wall_s = round(time.monotonic() - self.t0, 3)
        manifest.exitstatus = int(exitstatus)
        manifest.spawns = self.groups_started()
        manifest.spawn_s = self._spawn_costs()
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

    def _spawn_costs(self) -> dict[str, float]:
        """Per pool spec, the seconds this shard's tests waited for its groups to start, as
        the broker measured them: their sum in a serial session (each wait lengthened the
        shard), the longest one under xdist (the workers waited side by side). A spec none
        of whose tests carried a measurement is left out (the partition's default stands)."""
        parallel = bool(getattr(self.config.option, "numprocesses", None))
        costs: dict[str, float] = {}
        for test_id, record in self.records.items():
            label = self.specs.get(test_id)
            if label is None or record.spawn_wait_s is None:
                continue
            seen = costs.get(label, 0.0)
            wait = record.spawn_wait_s
            costs[label] = round(max(seen, wait) if parallel else seen + wait, 3)
        return costs

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        manifest = self.manifest
        if manifest is None or self.is_worker:
            return
        where = f"; results in {self.results}" if self.results is not None else ""
        terminalreporter.write_sep(
            "-",
            f"cpq fan-out: shard {manifest.index}/{manifest.count} ran "
            f"{len(manifest.selected)} of {len(manifest.collected)} tests of run "
            f"{self.run_id}{where}",
        )
        if self.run_id_source == "random":
            terminalreporter.write_line(
                f"cpq fan-out: no CI run id found; this shard made up {self.run_id} (set "
                f"{runid.RUN_ID_VAR} to one id for every shard of a run to merge them)"
            )


class FanoutXdistController:
    """Hands each xdist worker's collection to the controller's :class:`FanoutPlugin`."""

    def __init__(self, plugin: FanoutPlugin) -> None:
        self.plugin = plugin

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        data = getattr(node, "workeroutput", {}).get(WORKER_KEY)
        if isinstance(data, dict):
            self.plugin.adopt(dict(data))


def deselects(config: pytest.Config) -> bool:
    """Whether this session is a shard (collected tests may not run here): the collection
    warm-up of ``cpq.client.plugin`` then waits for the share, so it starts no group for tests
    another shard keeps."""
    plugin = config.pluginmanager.get_plugin("cpq-fanout")
    return isinstance(plugin, FanoutPlugin) and plugin.deselects()


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
