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
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cpq.fanout import brokerargs, durations, junit, runid
from cpq.fanout.attempts import TimelineTail, carry_over, run_record, timeline_file
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
#: What ``--cpq-shard-by`` keeps on one shard: a test alone, a module's tests, a class's.
SHARD_BY = ("test", "module", "class")
SHARD_BY_VAR = "CPQ_SHARD_BY"
#: The spawn-cost label of waits of tests with no pool spec known at collection (torchrun
#: launches under ``--cpq-torchrun``, ``cpq.run`` from a test without a marker).
UNMARKED_WAITS = "unmarked"
#: The run's partition input a controller hands its xdist workers (``workerinput``).
RUN_RECORD_KEY = "cpq_run_record"
#: The sections cpq adds after the failing rank's report of a test the ranks ran
#: (``cpq.client.combine``, docs/design.md "Fan-out"): not the exception pytest's JUnit
#: ``message`` names.
_CPQ_SECTION = re.compile(r"\n-{20} (?:cpq|rank \d+) -{20}\n")
#: cpq's last line naming the failing ranks (``cpq.client.report``), never the message.
_TRAILER = re.compile(r"^(cpq: )?failed on rank\(s\) ")


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
    group.addoption(
        "--cpq-shard-by",
        default=None,
        choices=SHARD_BY,
        help="what a shard keeps together: each test alone (default), each module's tests, "
        "or each class's tests (CPQ_SHARD_BY, ini cpq_shard_by)",
    )
    parser.addini("cpq_shard_by", "what a shard keeps together: test, module or class")


def shard_by(config: pytest.Config) -> str:
    """``--cpq-shard-by``, else ``CPQ_SHARD_BY``, else ini ``cpq_shard_by``, else ``test``."""
    value = (
        config.getoption("cpq_shard_by", None)
        or os.environ.get(SHARD_BY_VAR)
        or config.getini("cpq_shard_by")
        or "test"
    )
    value = str(value).strip().lower()
    if value not in SHARD_BY:
        raise pytest.UsageError(
            f"cpq: shard by {value!r} (CPQ_SHARD_BY or ini cpq_shard_by): expected one of "
            + ", ".join(SHARD_BY)
        )
    return value


def _group(item: pytest.Item, by: str) -> str:
    """The unit a test shares a shard with: "" (alone), its module's path, or its outermost
    class's node id (a test outside any class stays alone)."""
    if by == "module":
        return item.nodeid.split("::", 1)[0]
    if by == "class" and getattr(item, "cls", None) is not None:
        return "::".join(item.nodeid.split("::", 2)[:2])
    return ""


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


def _crash(report: pytest.TestReport) -> str:
    """The failure's message as pytest's JUnit gives it: the exception line (``reprcrash``),
    else the report's text, less what cpq adds about the ranks (:data:`_CPQ_SECTION`); where
    cpq's line about the ranks is all there is, the report's ``E`` lines."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = str(getattr(crash, "message", "") or "")
    if not message:
        message = _CPQ_SECTION.split(str(report.longrepr), maxsplit=1)[0].strip()
    if _TRAILER.match(message):
        lines = report.longreprtext.splitlines()
        start = next((n for n, line in enumerate(lines) if line.startswith("E ")), None)
        if start is not None:
            block = []
            for line in lines[start:]:
                if not line.startswith("E "):
                    break
                block.append(line[1:].strip())
            message = "\n".join(block)
    return message


def _record(records: dict[str, TestRecord], report: pytest.TestReport) -> None:
    """Fold one phase's report into the test's record, with what pytest's JUnit says of it
    (``junitxml``: the message of a failure or error, a skip's reason and location, an
    xfail's reason)."""
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
        record.when = report.when
        record.message = _crash(report)
        record.details = report.longreprtext[-DETAILS_LIMIT:]
    elif report.skipped and record.outcome == "passed":
        record.outcome = "skipped"
        longrepr = report.longrepr
        if hasattr(report, "wasxfail"):
            record.kind = "pytest.xfail"
            record.message = str(report.wasxfail).removeprefix("reason: ")
        elif isinstance(longrepr, tuple):
            reason = str(longrepr[2]).removeprefix("Skipped: ")
            record.kind = "pytest.skip"
            record.message = reason
            record.details = f"{longrepr[0]}:{longrepr[1]}: {reason}"
        else:
            record.kind, record.message = "pytest.skip", "skipped"


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
        self.shard_by = shard_by(config)
        #: The partition input this run's shards recorded (durations, shard-by, where), which
        #: a rerun of a shard of the run uses instead of today's durations file; a worker's
        #: comes from its controller.
        self.run_input: dict[str, Any] | None = getattr(config, "workerinput", {}).get(
            RUN_RECORD_KEY
        )
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
        if self.shard is not None:  # before carry_over clears this shard's own manifest
            found = run_record(self.results, index, count, self.run_id)
            if found is not None:
                self.run_input = {
                    "durations": found.run_durations,
                    "shard_by": found.shard_by,
                    "from": found.durations_from,
                    "record": Path(found.path).name,
                }
        self.attempts = carry_over(self.results, index, count, self.run_id)

    # ----------------------------------------------------------------- collection

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        if not self.active:
            return
        index, count = (self.shard.index, self.shard.count) if self.shard else (0, 1)
        if self.run_input is not None:  # the run's own partition input, fixed at its start
            recorded = dict(self.run_input["durations"])
            by, source = str(self.run_input["shard_by"]), str(self.run_input["from"])
        else:
            try:
                recorded = durations.load(self.durations_path)
            except durations.DurationsError as exc:
                raise pytest.UsageError(f"cpq: {exc}") from None
            by, source = self.shard_by, str(self.durations_path)
        tests = [TestInfo(item.nodeid, _spec(item), _group(item, by)) for item in items]
        self.specs = {t.test_id: t.spec for t in tests if t.spec is not None}
        collected = [t.test_id for t in tests]
        known = set(collected)
        # What the partition reads (the collected tests' seconds, the spawn costs): recorded
        # in the manifest, so a rerun of this shard computes the same share from it.
        recorded = {k: v for k, v in recorded.items() if k in known or k.startswith(SPAWN_PREFIX)}
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
            run_durations=recorded,
            durations_from=source,
            shard_by=by,
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
            label = self.specs.get(test_id) or UNMARKED_WAITS
            if record.spawn_wait_s is None:
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
        if self.run_input is not None and self.shard is not None:
            terminalreporter.write_line(
                f"cpq fan-out: the partition run {self.run_id} started with (durations of "
                f"{manifest.durations_from}, shard by {manifest.shard_by}, as "
                f"{self.run_input.get('record', '?')} recorded them); {self.durations_path} "
                "as it is now is not read"
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

    def pytest_configure_node(self, node: Any) -> None:
        """A worker computes the share from the run's recorded input too (the controller
        read it before it cleared this shard's files)."""
        if self.plugin.run_input is not None:
            node.workerinput[RUN_RECORD_KEY] = self.plugin.run_input

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


def records(config: pytest.Config) -> bool:
    """Whether this session keeps the fan-out's records (a shard, ``--cpq-results``,
    ``--cpq-write-durations``): only then do a test's reports carry
    :data:`RANK_TIME_PROPERTY`, which its records alone read (a fresh run's JUnit file has no
    such property, and a strict xunit2 reader refuses a testcase's properties)."""
    plugin = config.pluginmanager.get_plugin("cpq-fanout")
    return isinstance(plugin, FanoutPlugin) and plugin.active


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
