"""Benchmark: the context-parallel attention suite run four ways, side by side, in one run.

Why this exists (issue 4): cpq's claim is that a distributed test suite spends its time
starting processes, and that warm groups shared through a broker remove that cost without
giving up what a pytest suite gives. The claim is only worth something measured against
what people actually do, on the same cases, in the same run, on the same machine:

1. ``torchrun`` per case: ``python -m torch.distributed.run --standalone --nproc-per-node W``
   of a tiny driver (this file with ``--one-case``) that inits the process group, runs one
   case and exits: what most suites do.
2. the stdio-fed pool (``tools/stdio_pool.py``, a faithful re-implementation of Transformer
   Engine's pool): one warm group per world size, fed JSON on stdin, one driver process.
3. cpq, one pytest session: a generated test file with N ``@pytest.mark.cpq`` tests run with
   ``python -m pytest`` against a fresh broker this script starts (so the group spawn is
   counted).
4. cpq with ``pytest -n 2`` (pytest-xdist): two workers share one fresh broker; the plugin's
   warm-up asks for one group per xdist worker.

Two more rows, for diagnosis rather than as modes of their own:

* (2p) the stdio-fed pool driven from one pytest session (a session fixture holding the
  pool, as Transformer Engine's suite does): pytest startup, collection (the test module
  imports torch) and teardown are then paid on both sides, so (3) against (2p) is the
  pool against the pool. (2) is a bare driver that never imports torch or pytest.
* (3e) experiment: (3) with a conftest that sends the warm-up at ``pytest_sessionstart``
  (before collection imports torch) instead of after collection: what an earlier warm-up
  would buy. Not a shipped behaviour of the plugin.

Everything is started with ``sys.executable -m ...`` (never console scripts) so the same
script runs on a host where cpq is only on ``PYTHONPATH``, not installed. The pytest modes
run with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` and name their plugins (``-p cpq.client.plugin``,
``-p xdist.plugin``), so unrelated plugins installed on the machine are not billed to them
(``--autoload`` measures with everything loaded).

Definitions (the table and the JSON use exactly these):

* ``wall``: the whole mode, end to end, as the user waits for it: (1) the sum of the
  per-case ``torchrun`` walls, extrapolated to N when only K < N cases were run; (2) the
  ``python tools/stdio_pool.py cases.json`` process; (2p)/(3)/(4)/(3e) the ``python -m
  pytest`` process. The broker's own start (before pytest) is reported separately
  (``broker_start_s``), not in ``wall``: a node's broker normally outlives sessions.
* ``in-task``: time inside ``run_cp_attention`` on rank 0, measured the same way in every
  mode (around the call, on the rank; (2)/(2p): the pool's rank-0 ``duration_s``).
* ``overhead / case`` = (wall - sum of in-task) / N: everything that is not the case itself
  (process starts, group spawns, pytest, dispatch), spread over the cases.
* ``steady dispatch``: median over cases after each process's first of (round trip seen by
  the caller - in-task), i.e. the per-case cost once a group is warm; for pytest modes the
  round trip is the test's ``call`` phase, for (2) the pool driver's ``wall_s``.
* ``--repeat R`` runs every mode but (1) R times, interleaved; the run with the median wall
  is reported and every run is kept in the JSON (``all_runs``).

Usage::

    python tools/bench_cp.py --repeat 3 --markdown BENCHMARKS.md   # CPU: N=40 at ws=2, gloo
    python tools/bench_cp.py --spawn-cases 10      # mode (1) on 10 of the 40, scaled to 40
    python tools/bench_cp.py --gpu                 # GPU: GPU_CASES, nccl, ws=2 and ws=1
                                                   # (tools/gpu/run_cp_bench.sh wraps this)

Internal: ``--one-case JSON --record FILE`` is the mode (1) driver that torchrun starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchkit import PrivateBroker, child_env, run_logged

ROOT = Path(__file__).resolve().parents[1]
TARGET = "workers.cp_attention:run_cp_attention"
CPU_SECTION = "Context-parallel attention suite (CPU, gloo)"
GPU_SECTION = "Context-parallel attention suite (GPU, nccl)"
MODE_NAMES = {
    1: "torchrun per case",
    2: "stdio-fed pool",
    3: "cpq, one pytest session",
    4: "cpq, pytest -n 2",
    5: "experiment: (3) with warm-up sent at session start",
    6: "stdio-fed pool driven from one pytest session (as TE does)",
}
MODE_LABELS = {1: "(1)", 2: "(2)", 3: "(3)", 4: "(4)", 5: "(3e)", 6: "(2p)"}
DISPLAY_ORDER = [1, 2, 6, 3, 4, 5]
# --gpu runs in priority order (the comparisons first: (3) vs (4) at ws=2 and ws=1),
# so a run cut short by --budget-s loses the extras, not the point.
GPU_PLAN = [(2, 3), (2, 4), (1, 3), (1, 4), (2, 2), (1, 2), (2, 6), (2, 1), (2, 5)]


# --------------------------------------------------------------------------------------
# Mode (1) driver: runs inside torchrun, one case, then exits
# --------------------------------------------------------------------------------------


def one_case_main(case_json: str, record: str, backend: str) -> int:
    """What a per-case torchrun suite runs: init the group, run one case, tear down.

    Rank 0 appends ``{"in_task_s": ...}`` to ``record`` so in-task time is measured the same
    way as in the pooled modes (around the call, on rank 0).
    """
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    from workers.cp_attention import run_cp_attention

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        case = json.loads(case_json)
        start = time.perf_counter()
        outcome = "passed"
        try:
            run_cp_attention(**case)
        except AssertionError:
            outcome = "failed"
        in_task = time.perf_counter() - start
        if dist.get_rank() == 0:
            with open(record, "a") as fh:
                fh.write(json.dumps({"in_task_s": in_task, "outcome": outcome}) + "\n")
    finally:
        dist.destroy_process_group()
    return 0 if outcome == "passed" else 1


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


@dataclass
class ModeResult:
    """One mode's measurements; ``wall_s`` is always for all N cases (see ``extrapolated``)."""

    mode: int
    name: str
    world_size: int
    backend: str
    n_cases: int
    wall_s: float
    in_task_sum_s: float
    group_spawns: int
    outcomes: dict[str, int]
    cases_run: int = 0
    extrapolated: bool = False
    measured_wall_s: float | None = None  # (1): the K cases actually run
    per_case_wall_mean_s: float | None = None
    steady_dispatch_median_s: float | None = None
    broker_start_s: float | None = None
    warmup: dict[str, Any] = field(default_factory=dict)
    pools: list[dict[str, Any]] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)
    loadavg_before: tuple[float, float, float] | None = None
    loadavg_after: tuple[float, float, float] | None = None
    rc: int = 0
    command: str = ""
    runs_wall_s: list[float] = field(default_factory=list)

    @property
    def overhead_per_case_s(self) -> float:
        return (self.wall_s - self.in_task_sum_s) / self.n_cases

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["overhead_per_case_s"] = self.overhead_per_case_s
        return data


_DEADLINE = [float("inf")]  # monotonic; set from --budget-s so one device call always ends


def _time_left(cap: float) -> float:
    """Seconds a child may run: ``cap``, or less when the run's budget is nearly spent."""
    return max(1.0, min(cap, _DEADLINE[0] - time.monotonic()))


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _count(outcomes: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


# --------------------------------------------------------------------------------------
# Mode (1): torchrun per case
# --------------------------------------------------------------------------------------


def mode_torchrun(
    cases: list[dict[str, Any]], ws: int, backend: str, k: int, work: Path, logs: Path
) -> ModeResult:
    """Run K of the N cases, each in its own torchrun; scale the wall to N if K < N."""
    record = work / "mode1_record.jsonl"
    record.unlink(missing_ok=True)
    env = child_env()
    walls: list[float] = []
    rcs: list[int] = []
    before = _loadavg()
    for case in cases[:k]:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ws}",
            str(Path(__file__).resolve()),
            "--one-case",
            json.dumps(case),
            "--record",
            str(record),
            "--backend",
            backend,
        ]
        if walls and _DEADLINE[0] - time.monotonic() < 2 * max(walls):
            break  # out of budget: scale from the cases that ran
        rc, wall, _, _ = run_logged(cmd, logs / "mode1_torchrun.log", env, ROOT, _time_left(300))
        walls.append(wall)
        rcs.append(rc)
    k = len(walls)
    rows = _read_jsonl(record)
    in_task = [r["in_task_s"] for r in rows]
    outcomes = [r["outcome"] for r in rows] + ["error"] * (k - len(rows))
    n = len(cases)
    mean_wall = sum(walls) / k
    mean_in_task = sum(in_task) / max(1, len(in_task))
    return ModeResult(
        mode=1,
        name=MODE_NAMES[1],
        world_size=ws,
        backend=backend,
        n_cases=n,
        cases_run=k,
        extrapolated=k < n,
        wall_s=mean_wall * n,
        measured_wall_s=sum(walls),
        per_case_wall_mean_s=mean_wall,
        in_task_sum_s=mean_in_task * n,
        group_spawns=n,
        outcomes=_count(outcomes),
        steady_dispatch_median_s=_median(
            [w - t for w, t in zip(walls[1:], in_task[1:], strict=False)]
        ),
        loadavg_before=before,
        loadavg_after=_loadavg(),
        rc=max(rcs, default=0),
        command=f"{k} x python -m torch.distributed.run --standalone --nproc-per-node={ws} "
        "tools/bench_cp.py --one-case ...",
    )


# --------------------------------------------------------------------------------------
# Mode (2): stdio-fed pool
# --------------------------------------------------------------------------------------


def mode_stdio(
    cases: list[dict[str, Any]], ws: int, backend: str, work: Path, logs: Path, run_no: int
) -> ModeResult:
    """``python tools/stdio_pool.py cases.json``: one warm group, one driver process."""
    cases_file = work / f"stdio_cases_ws{ws}.json"
    cases_file.write_text(
        json.dumps([{"target": TARGET, "kwargs": c, "world_size": ws} for c in cases])
    )
    env = child_env()
    env["STDIO_POOL_BACKEND"] = backend
    out_file = logs / f"m2ws{ws}r{run_no}_stdio.jsonl"
    cmd = [sys.executable, str(ROOT / "tools" / "stdio_pool.py"), str(cases_file)]
    before = _loadavg()
    start = time.perf_counter()
    with open(out_file, "wb") as out, open(logs / f"m2ws{ws}r{run_no}_stdio.stderr", "wb") as err:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=err, timeout=_time_left(600), check=False
        )
    wall = time.perf_counter() - start
    rows = [r for r in _read_jsonl(out_file) if "case" in r]
    in_task = [r["ranks"][0]["duration_s"] for r in rows if r.get("ranks")]
    round_trips = [r["wall_s"] for r in rows]
    first_wait = round_trips[0] - in_task[0] if rows and in_task else None
    outcomes = [r["outcome"] for r in rows] + ["error"] * (len(cases) - len(rows))
    return ModeResult(
        mode=2,
        name=MODE_NAMES[2],
        world_size=ws,
        backend=backend,
        n_cases=len(cases),
        cases_run=len(rows),
        wall_s=wall,
        in_task_sum_s=sum(in_task),
        group_spawns=1,
        outcomes=_count(outcomes),
        steady_dispatch_median_s=_median(
            [w - t for w, t in zip(round_trips[1:], in_task[1:], strict=False)]
        ),
        warmup={"first_case_wait_s": first_wait},
        loadavg_before=before,
        loadavg_after=_loadavg(),
        rc=proc.returncode,
        command=shlex.join(["python", "tools/stdio_pool.py", cases_file.name]),
    )


# --------------------------------------------------------------------------------------
# Modes (3) and (4): cpq through pytest, against a fresh broker
# --------------------------------------------------------------------------------------

CONFTEST = '''\
"""Timestamps for tools/bench_cp.py: session start, collection, each test's phases."""

import json
import os
import time

import pytest

EVENTS = {events!r}
EARLY_WARM = {early_warm!r}  # world size to warm at session start (experiment), or None


def _event(kind, **data):
    data.update(kind=kind, t=time.time(), pid=os.getpid(),
                worker=os.environ.get("PYTEST_XDIST_WORKER", "main"))
    with open(EVENTS, "a") as fh:
        fh.write(json.dumps(data) + "\\n")


def pytest_sessionstart(session):
    _event("session_start")
    if EARLY_WARM:
        # What the plugin could do with the previous run's specs (e.g. from config.cache):
        # ask for the group before collection imports torch, instead of after collection.
        try:
            from cpq.client.plugin import SESSION_KEY

            cpq_session = session.config.stash[SESSION_KEY]
            cpq_session.client.warm([cpq_session.spec(EARLY_WARM, None)], [1])
        except Exception as exc:  # the plugin's internals moved: the experiment is void
            _event("early_warm_failed", error=repr(exc))
        else:
            _event("early_warm_sent")


def pytest_collection_finish(session):
    _event("collection_finish", items=len(session.items))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    _event("logstart", nodeid=nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    _event("call_start", nodeid=item.nodeid, index=item.callspec.params["index"])


def pytest_runtest_logreport(report):
    # Under xdist the controller sees every worker's reports again: keep the worker's.
    if hasattr(report, "node") and os.environ.get("PYTEST_XDIST_WORKER") is None:
        return
    if report.when == "call" or report.outcome != "passed":
        _event("report", nodeid=report.nodeid, when=report.when, outcome=report.outcome,
               duration=report.duration)


def pytest_runtest_logfinish(nodeid, location):
    _event("logfinish", nodeid=nodeid)


def pytest_sessionfinish(session, exitstatus):
    roots = None
    try:
        from cpq.client.plugin import SESSION_KEY

        roots = session.config.stash[SESSION_KEY].roots()
    except Exception:
        pass
    _event("session_finish", exitstatus=int(exitstatus), roots=roots)
'''

TEST_FILE = '''\
"""The CP attention suite as a user ports it (cf. tests/test_cp_attention.py), N cases."""

import json
import os
import time

import pytest
import torch.distributed as dist

from workers.cp_attention import {cases_name}, case_id, run_cp_attention

N = {n}
BODIES = {bodies!r}
INDEXES = list(range(N))
IDS = [f"{{i:02d}}-{{case_id({cases_name}[i % len({cases_name})])}}" for i in INDEXES]


def _case(index):
    return {cases_name}[index % len({cases_name})]


@pytest.mark.cpq(world_size={ws})
@pytest.mark.parametrize("index", INDEXES, ids=IDS)
def test_cp_attention(index):
    t_start = time.time()
    start = time.perf_counter()
    errors = run_cp_attention(**_case(index))
    in_task = time.perf_counter() - start
    if dist.get_rank() == 0:
        with open(BODIES, "a") as fh:
            fh.write(json.dumps({{"index": index, "t_start": t_start, "in_task_s": in_task,
                                  "pid": os.getpid(),
                                  "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}}) + "\\n")
    assert errors["world_size"] == {ws}
'''


STDIO_TEST_FILE = '''\
"""The same suite the way Transformer Engine drives its stdio-fed pool: from pytest."""

import json
import sys
import time

import pytest

sys.path.insert(0, {tools!r})
from stdio_pool import StdioPool  # noqa: E402

from workers.cp_attention import {cases_name}, case_id  # noqa: E402  (imports torch)

N = {n}
BODIES = {bodies!r}
INDEXES = list(range(N))
IDS = [f"{{i:02d}}-{{case_id({cases_name}[i % len({cases_name})])}}" for i in INDEXES]


@pytest.fixture(scope="session")
def pool():
    with open({pool_log!r}, "ab") as log:
        with StdioPool({ws}, cwd={root!r}, env={{"STDIO_POOL_BACKEND": {backend!r}}},
                       stderr=log.fileno()) as p:
            yield p


@pytest.mark.parametrize("index", INDEXES, ids=IDS)
def test_cp_attention(pool, index):
    result = pool.run({target!r}, {cases_name}[index % len({cases_name})])
    in_task = result["ranks"][0]["duration_s"] if result.get("ranks") else 0.0
    with open(BODIES, "a") as fh:  # rank-side start approximated as now - in-task
        fh.write(json.dumps({{"index": index, "t_start": time.time() - in_task,
                              "in_task_s": in_task, "pid": 0, "gpus": ""}}) + "\\n")
    assert result["outcome"] == "passed", result
'''


def _pytest_args(mode: int, autoload: bool) -> list[str]:
    """By default plugins are named explicitly and nothing else installed loads.

    Why: whatever else a machine has installed would be billed to the pytest modes (here
    hypothesis' plugin imports hypothesis in ``pytest_terminal_summary``), and naming
    ``cpq.client.plugin`` works where cpq is only on PYTHONPATH. With ``autoload`` (``--autoload``,
    to measure what the installed plugins cost) ``-p cpq.client.plugin`` is passed only where the
    entry point is missing: passing it as well would register the module twice.
    """
    args = ["-q", "-p", "no:cacheprovider"]
    installed = any(ep.name == "cpq" for ep in importlib.metadata.entry_points(group="pytest11"))
    if mode in (3, 4, 5) and not (autoload and installed):
        args += ["-p", "cpq.client.plugin"]
    if mode == 4:
        args += ([] if autoload else ["-p", "xdist.plugin"]) + ["-n", "2"]
    return args


def mode_pytest(
    mode: int,
    cases_name: str,
    n: int,
    ws: int,
    backend: str,
    gpus: str,
    work: Path,
    logs: Path,
    probe: int,
    run_no: int,
    autoload: bool = False,
) -> ModeResult:
    """A generated N-test file under ``python -m pytest``.

    Modes 3/4/5 use the cpq marker against a fresh broker (``-n 2`` for mode 4; mode 5 adds
    a conftest that sends the warm-up at ``pytest_sessionstart``: an experiment measuring
    what an earlier warm-up would buy). Mode 6 drives the stdio-fed pool from a session
    fixture: the same pytest costs as cpq's modes, so the difference is the pool itself.
    """
    tag = f"m{mode}ws{ws}r{run_no}"
    suite = work / tag
    suite.mkdir()
    events = suite / "events.jsonl"
    bodies = suite / "bodies.jsonl"
    (suite / "pytest.ini").write_text("[pytest]\naddopts =\n")  # rootdir here, no repo config
    (suite / "conftest.py").write_text(
        CONFTEST.format(events=str(events), early_warm=ws if mode == 5 else None)
    )
    if mode == 6:
        test = STDIO_TEST_FILE.format(
            tools=str(ROOT / "tools"),
            cases_name=cases_name,
            n=n,
            bodies=str(bodies),
            ws=ws,
            root=str(ROOT),
            backend=backend,
            target=TARGET,
            pool_log=str(logs / f"{tag}_pool.stderr"),
        )
    else:
        test = TEST_FILE.format(cases_name=cases_name, n=n, bodies=str(bodies), ws=ws)
    (suite / "test_bench_cp.py").write_text(test)
    env = child_env()
    if not autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    broker = (
        PrivateBroker(work / f"state-{tag}", logs / f"broker-{tag}", gpus, env)
        if mode != 6
        else None
    )
    status_time, status, profile = 0.0, None, {}
    args = _pytest_args(mode, autoload)
    cmd = [sys.executable, "-m", "pytest", *args, "test_bench_cp.py"]
    try:
        session_env = dict(broker.env, CPQ_AUTOSTART="0") if broker else env
        before = _loadavg()
        rc, wall, launched, _ = run_logged(
            cmd, logs / f"{tag}_pytest.log", session_env, suite, timeout=_time_left(600)
        )
        after = _loadavg()
        if broker is not None:
            status = broker.status()
            status_time = time.time()
            roots = next(
                (e["roots"] for e in _read_jsonl(events) if e["kind"] == "session_finish"), None
            )
            if probe and mode == 3 and roots:
                profile = _probe_cpq(broker, ws, probe, roots)
    finally:
        if broker is not None:
            broker.stop()
    result = _pytest_result(mode, ws, backend, n, wall, launched, events, bodies, status_time,
                            status)  # fmt: skip
    result.broker_start_s = broker.start_s if broker else None
    result.profile.update(profile)
    result.loadavg_before, result.loadavg_after = before, after
    result.rc = rc
    result.command = shlex.join(["python", "-m", "pytest", *args, "test_bench_cp.py"])
    return result


def _probe_cpq(broker: PrivateBroker, ws: int, count: int, roots: list[str]) -> dict[str, Any]:
    """Pure cpq dispatch cost, pytest out of the picture: a no-op task (``os:getpid``)
    through ``Client.submit`` on the session's warm group (same spec: same roots)."""
    from cpq import Client

    rtts = []
    with Client(broker.endpoint, name="bench_cp-probe") as client:
        for _ in range(count):
            start = time.perf_counter()
            result = client.submit("os:getpid", ws, roots=roots)
            rtts.append(time.perf_counter() - start)
            if result.outcome != "passed":
                return {"probe_error": f"{result.outcome}: {result.message}"}
        groups = client.status()["totals"]["groups_started"]
    return {
        "noop_round_trip_median_s": statistics.median(rtts),
        "noop_round_trip_min_s": min(rtts),
        "noop_round_trips": len(rtts),
        "groups_started_after_probe": groups,
    }


def _pytest_result(
    mode: int,
    ws: int,
    backend: str,
    n: int,
    wall: float,
    launched: float,
    events_path: Path,
    bodies_path: Path,
    status_time: float,
    status: dict[str, Any] | None,
) -> ModeResult:
    """Read the conftest's and the test bodies' timestamps back into one ModeResult.

    All times in ``warmup``/``pools``/``profile.timeline`` are seconds after the pytest
    process was launched, so the spawn can be laid against collection and the first test.
    """
    events = _read_jsonl(events_path)
    bodies = {b["index"]: b for b in _read_jsonl(bodies_path)}

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - launched, 3)

    def first(kind: str, worker: str | None = None) -> float | None:
        ts = [e["t"] for e in events if e["kind"] == kind and worker in (None, e["worker"])]
        return min(ts, default=None)

    calls = [e for e in events if e["kind"] == "call_start"]
    reports: dict[tuple[str, str], dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "report":
            reports.setdefault((e["nodeid"], e["when"]), e)
    call_reports = {nodeid: e for (nodeid, when), e in reports.items() if when == "call"}
    outcomes = [e["outcome"] for e in call_reports.values()]
    outcomes += ["error"] * sum(1 for (_, when) in reports if when != "call")
    outcomes += ["error"] * max(0, n - len(outcomes))

    # Per pytest process (one, or one per xdist worker): when its first test asked for a
    # group and how long that test waited before its body started on a rank; the steady
    # dispatch cost leaves each process's first test out (it waited for a group).
    first_tests = []
    steady = []
    for worker in sorted({c["worker"] for c in calls}):
        mine = sorted((c for c in calls if c["worker"] == worker), key=lambda c: c["t"])
        body = bodies.get(mine[0]["index"])
        first_tests.append(
            {
                "worker": worker,
                "session_start_s": rel(first("session_start", worker)),
                "collection_finish_s": rel(first("collection_finish", worker)),
                "first_call_start_s": rel(mine[0]["t"]),
                "first_body_start_s": rel(body["t_start"]) if body else None,
                "first_test_wait_s": round(body["t_start"] - mine[0]["t"], 3) if body else None,
                "tests": len(mine),
            }
        )
        for call in mine[1:]:
            body, report = bodies.get(call["index"]), call_reports.get(call["nodeid"])
            if body and report:
                steady.append(report["duration"] - body["in_task_s"])
    pools = []
    for pool in status["pools"] if status else []:
        spawn_start = status_time - pool["uptime_s"]
        ready = pool.get("ready_after_s")
        pools.append(
            {
                "id": pool["id"],
                "gpus": pool.get("gpus"),
                "tasks_done": pool["tasks_done"],
                "spawn_start_s": rel(spawn_start),
                "ready_after_s": None if ready is None else round(ready, 3),
                "ready_at_s": None if ready is None else rel(spawn_start + ready),
            }
        )
    pools.sort(key=lambda p: p["spawn_start_s"] or 0.0)
    starts = {e["nodeid"]: e["t"] for e in events if e["kind"] == "logstart"}
    finishes = {e["nodeid"]: e["t"] for e in events if e["kind"] == "logfinish"}
    outside_call = [
        finishes[k] - starts[k] - r["duration"]
        for k, r in call_reports.items()
        if k in starts and k in finishes
    ]
    last_finish = max(finishes.values(), default=None)
    timeline = {
        "session_start_s": rel(first("session_start")),
        "early_warm_sent_s": rel(first("early_warm_sent")),
        "early_warm_error": next(
            (e["error"] for e in events if e["kind"] == "early_warm_failed"), None
        ),
        "collection_finish_s": rel(first("collection_finish")),
        "first_body_start_s": rel(min((b["t_start"] for b in bodies.values()), default=None)),
        "last_test_finish_s": rel(last_finish),
        "session_finish_s": rel(
            max((e["t"] for e in events if e["kind"] == "session_finish"), default=None)
        ),
        "exit_s": round(wall, 3),
    }
    return ModeResult(
        mode=mode,
        name=MODE_NAMES[mode],
        world_size=ws,
        backend=backend,
        n_cases=n,
        cases_run=len(bodies),
        wall_s=wall,
        in_task_sum_s=sum(b["in_task_s"] for b in bodies.values()),
        group_spawns=int(status["totals"]["groups_started"]) if status else 1,
        outcomes=_count(outcomes),
        steady_dispatch_median_s=_median(steady),
        warmup={"first_tests": first_tests},
        pools=pools,
        profile={
            "timeline": timeline,
            "pytest_per_test_outside_call_median_s": _median(outside_call),
            "totals": status["totals"] if status else None,
            "rank_pids": sorted({b["pid"] for b in bodies.values()}),
        },
    )


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2, unit: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{unit}"


def table(results: list[ModeResult]) -> str:
    """Markdown table; ratios are against (1) and (2) of the same world size, if run."""
    by = {(r.world_size, r.mode): r for r in results}
    head = (
        "| mode | ws | wall (s) | group spawns | in-task Σ (s) | overhead / case (s) "
        "| steady dispatch / case (s) | x faster than (1) | time ÷ (2) | time ÷ (2p) "
        "| outcomes |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    rows = []
    for r in results:
        base1, base2 = by.get((r.world_size, 1)), by.get((r.world_size, 2))
        base2p = by.get((r.world_size, 6))
        wall = _fmt(r.wall_s, 1)
        if r.mode == 1:
            how = f"{r.per_case_wall_mean_s:.2f} s/case"
            if r.extrapolated:
                how = f"extrapolated: {r.cases_run} cases took {r.measured_wall_s:.1f} s, {how}"
            wall += f" ({how})"
        elif len(r.runs_wall_s) > 1:
            wall += (
                f" (median of {len(r.runs_wall_s)}: "
                + ", ".join(f"{w:.1f}" for w in r.runs_wall_s)
                + ")"
            )
        spawns = f"{r.group_spawns} (1 per case)" if r.mode == 1 else str(r.group_spawns)
        rows.append(
            f"| {MODE_LABELS[r.mode]} {r.name} | {r.world_size} | {wall} | {spawns} "
            f"| {_fmt(r.in_task_sum_s)} | {_fmt(r.overhead_per_case_s, 3)} "
            f"| {_fmt(r.steady_dispatch_median_s, 4)} "
            f"| {_fmt(base1.wall_s / r.wall_s if base1 else None, 1, 'x')} "
            f"| {_fmt(r.wall_s / base2.wall_s if base2 else None, 2)} "
            f"| {_fmt(r.wall_s / base2p.wall_s if base2p else None, 2)} "
            f"| {', '.join(f'{v} {k}' for k, v in sorted(r.outcomes.items()))} |"
        )
    return head + "\n".join(rows) + "\n"


def warmup_lines(results: list[ModeResult]) -> str:
    """How long the first test of each cpq session waited, against the group's spawn.

    Times are seconds after the pytest process was launched.
    """
    lines = []
    for r in results:
        if r.mode not in (3, 4, 5, 6):
            continue
        t = r.profile.get("timeline", {})
        lines.append(
            f"* {MODE_LABELS[r.mode]} ws={r.world_size}: pytest session start "
            f"{_fmt(t.get('session_start_s'))}"
            + (
                f", warm-up sent {_fmt(t['early_warm_sent_s'])}"
                if t.get("early_warm_sent_s") is not None
                else ""
            )
            + f", collection done {_fmt(t.get('collection_finish_s'))}, last test done "
            f"{_fmt(t.get('last_test_finish_s'))}, exit {_fmt(t.get('exit_s'))} s"
        )
        for p in r.pools:
            lines.append(
                f"  * group {p['id']}{' GPUs ' + ','.join(p['gpus']) if p['gpus'] else ''}: "
                f"spawn {_fmt(p['spawn_start_s'])} → ready {_fmt(p['ready_at_s'])} s "
                f"(ready_after_s {_fmt(p['ready_after_s'])}), {p['tasks_done']} tasks"
            )
        for ft in r.warmup.get("first_tests", []):
            lines.append(
                f"  * {ft['worker']}: collection done {_fmt(ft['collection_finish_s'])}, first "
                f"test called {_fmt(ft['first_call_start_s'])}, its body started on a rank "
                f"{_fmt(ft['first_body_start_s'])} s → **waited "
                f"{_fmt(ft['first_test_wait_s'])} s** for its group"
            )
    return "\n".join(lines) + ("\n" if lines else "")


def verdicts(results: list[ModeResult]) -> list[str]:
    """The issue's targets, checked and stated (not asserted: the numbers are the result)."""
    out = []
    for ws in sorted({r.world_size for r in results}, reverse=True):
        by = {r.mode: r for r in results if r.world_size == ws}
        three = by.get(3)
        if three is None:
            continue
        if 1 in by:
            speedup = by[1].wall_s / three.wall_s
            ok = "met" if speedup >= 20 else "NOT met"
            out.append(f"ws={ws}: (3) is {speedup:.1f}x faster than (1) — target ≥ 20x: {ok}")
        if 2 in by:
            ratio = three.wall_s / by[2].wall_s
            ok = "met" if ratio <= 1.05 else "NOT met"
            out.append(f"ws={ws}: (3) takes {ratio:.2f}x the time of (2) — target ≤ 1.05: {ok}")
        if 6 in by:
            out.append(
                f"ws={ws}: (3) takes {three.wall_s / by[6].wall_s:.2f}x the time of (2p), the "
                "stdio pool driven from pytest (same pytest costs on both sides)"
            )
        if 4 in by:
            out.append(f"ws={ws}: (4) takes {by[4].wall_s / three.wall_s:.2f}x the time of (3)")
        if 5 in by and 2 in by:
            out.append(
                f"ws={ws}: (3e) (warm-up at session start) takes "
                f"{by[5].wall_s / by[2].wall_s:.2f}x the time of (2)"
            )
        probe = three.profile.get("noop_round_trip_median_s")
        if probe is not None:
            out.append(
                f"ws={ws}: cpq no-op round trip (Client.submit of os:getpid on the warm "
                f"group, no pytest): median {probe * 1e3:.1f} ms"
            )
    return out


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    gpus = ""
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(Exception):
            gpus = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False
            ).stdout.strip()
    versions = {}
    for dist in ("torch", "pytest", "pytest-xdist", "pyzmq"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    with contextlib.suppress(Exception):
        import zmq

        versions.setdefault("pyzmq", zmq.__version__)
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "gpus": gpus or "no GPU",
        "python": platform.python_version(),
        "versions": versions,
    }


def markdown(
    title: str, info: dict[str, Any], command: str, results: list[ModeResult], notes: str
) -> str:
    """This run's BENCHMARKS.md section: machine, date, command, table, targets, warm-up."""
    gpus = info["gpus"].replace("\n", "; ")
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    return (
        f"## {title}\n\n"
        f"Machine: `nproc` = {info['nproc']}, {info['cpu']}, {gpus}; Python {info['python']}, "
        f"{versions}. Date: {info['date']}.\n\n"
        f"Command:\n\n```\n{command}\n```\n\n"
        + table(results)
        + "\n"
        + "\n".join(f"* {v}" for v in verdicts(results))
        + "\n\nWarm-up: when the first test of each cpq session got its group (seconds after "
        "the pytest process was launched):\n\n"
        + warmup_lines(results)
        + (f"\n{notes.strip()}\n" if notes.strip() else "")
    )


def write_section(path: Path, title: str, section: str) -> None:
    """Replace ``## title`` (up to the next ``## ``) in ``path``, or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines(keepends=True)
    header = f"## {title}\n"
    if header in lines:
        start = lines.index(header)
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        lines[start:end] = [section.rstrip("\n") + "\n" + ("\n" if end < len(lines) else "")]
        text = "".join(lines)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def _save(path: Path, info: dict[str, Any], results: list[ModeResult], all_runs: list[Any]) -> None:
    """Written after every mode, so a run cut short still leaves what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        **info,
        "definitions": {
            "wall_s": "whole mode end to end (1: sum of per-case torchrun walls, scaled to N "
            "if extrapolated; 2: stdio_pool.py process; 3/4/3e: python -m pytest process, "
            "broker start excluded and reported as broker_start_s); with --repeat, the run "
            "with the median wall is reported and every run is in all_runs",
            "in_task_sum_s": "sum over cases of rank 0's time inside run_cp_attention",
            "overhead_per_case_s": "(wall_s - in_task_sum_s) / n_cases",
            "steady_dispatch_median_s": "median over cases after each process's first of "
            "(caller's round trip - in-task); 3/4: pytest call phase, 2: pool wall_s",
            "times in warmup/pools/profile.timeline": "seconds after the pytest process was "
            "launched",
        },
        "results": [r.to_json() for r in results],
        "verdicts": verdicts(results),
        "all_runs": all_runs,
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def _display_order(result: ModeResult) -> tuple[int, int]:
    """Tables read ws=2 before ws=1, and baselines before cpq, whatever order ran."""
    return (-result.world_size, DISPLAY_ORDER.index(result.mode))


def _representative(runs: list[ModeResult]) -> ModeResult:
    """The run with the median wall (lower median for an even count), carrying all walls."""
    ordered = sorted(runs, key=lambda r: r.wall_s)
    chosen = ordered[(len(ordered) - 1) // 2]
    chosen.runs_wall_s = [r.wall_s for r in runs]
    return chosen


def render(json_path: Path, markdown_path: Path, notes: str) -> int:
    """Rewrite the BENCHMARKS.md section from a saved results JSON (no re-run): the GPU
    numbers come back from the device host as JSON, and prose notes change more often than
    the numbers do."""
    data = json.loads(json_path.read_text())
    known = {f.name for f in dataclasses.fields(ModeResult)}
    results = [ModeResult(**{k: v for k, v in r.items() if k in known}) for r in data["results"]]
    title = GPU_SECTION if data.get("backend") == "nccl" else CPU_SECTION
    section = markdown(title, data, data["command"], results, notes)
    write_section(markdown_path, title, section)
    print(f"bench_cp: section '{title}' written to {markdown_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", type=int, help="N cases (default: 40 CPU, len(GPU_CASES) GPU)")
    parser.add_argument(
        "--spawn-cases",
        type=int,
        help="K: run mode (1) on the first K cases and scale to N (default: N on CPU, 3 GPU)",
    )
    parser.add_argument("--gpu", action="store_true", help="GPU_CASES with nccl at ws=2 and ws=1")
    parser.add_argument(
        "--modes",
        default="1,2,6,3,4,5",
        help="modes at ws=2, in this order: 1-4 as in the module doc, 5 = experiment (3e) "
        "(warm-up at session start), 6 = (2p) stdio pool under pytest (default 1,2,6,3,4,5)",
    )
    parser.add_argument(
        "--plan",
        help="explicit WS:MODE,... run order (overrides --modes/--ws1-modes), e.g. 2:3,1:3",
    )
    parser.add_argument(
        "--ws1-modes",
        help="modes to run again at ws=1 after ws=2 (default: 2,3,4 with --gpu, none on CPU)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds of modes 2-6, interleaved (median reported)"
    )
    parser.add_argument(
        "--autoload",
        action="store_true",
        help="pytest modes load every installed plugin (default: only cpq / xdist)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="stop starting modes (and cut children) so the run ends within this many seconds",
    )
    parser.add_argument("--probe", type=int, default=20, help="no-op cpq round trips (0: none)")
    parser.add_argument("--json", type=Path, help="results JSON (default tools/results/...)")
    parser.add_argument("--markdown", type=Path, help="write/replace this run's section here")
    parser.add_argument(
        "--notes", default="", help="text appended to the markdown section (@FILE: from a file)"
    )
    parser.add_argument(
        "--render", type=Path, help="only rewrite --markdown's section from this results JSON"
    )
    parser.add_argument(
        "--log-dir", type=Path, help="child logs (default: inside the work dir, which is kept)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir (suites, state)")
    parser.add_argument("--one-case", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.notes.startswith("@"):
        args.notes = Path(args.notes[1:]).read_text()
    if args.one_case is not None:
        return one_case_main(args.one_case, args.record, args.backend)
    if args.render is not None:
        if args.markdown is None:
            parser.error("--render needs --markdown")
        return render(args.render, args.markdown, args.notes)

    sys.path.insert(0, str(ROOT))
    from workers.cp_attention import CASES, GPU_CASES

    cases_name = "GPU_CASES" if args.gpu else "CASES"
    source = GPU_CASES if args.gpu else CASES
    n = args.cases or (len(GPU_CASES) if args.gpu else 40)
    k = min(n, args.spawn_cases or (3 if args.gpu else n))
    cases = [source[i % len(source)] for i in range(n)]
    backend = "nccl" if args.gpu else "gloo"
    gpus = "auto" if args.gpu else "none"
    json_path = args.json or ROOT / "tools" / "results" / (
        "bench_cp_gpu.json" if args.gpu else "bench_cp_cpu.json"
    )
    work = Path(tempfile.mkdtemp(prefix="cpqb-"))  # short: ipc paths have a length limit
    logs = args.log_dir or work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "tools/bench_cp.py", *(sys.argv[1:] if argv is None else argv)])
    info: dict[str, Any] = {
        "date": _dt.date.today().isoformat(),
        **machine(),
        "command": command,
        "n_cases": n,
        "spawn_cases": k,
        "cases": cases_name,
        "backend": backend,
        "repeat": args.repeat,
        "pytest_plugin_autoload": args.autoload,
        "loadavg_start": _loadavg(),
    }
    if args.budget_s:
        _DEADLINE[0] = time.monotonic() + args.budget_s
    print(f"bench_cp: {n} cases of {cases_name} ({backend}); work dir {work}; logs {logs}")
    # Untimed: the first interpreter to import torch pays the page cache, not a mode.
    subprocess.run([sys.executable, "-c", "import torch"], env=child_env(), check=False)

    if args.plan:
        plan = [(int(w), int(m)) for w, m in (p.split(":") for p in args.plan.split(",") if p)]
    else:
        ws1 = args.ws1_modes if args.ws1_modes is not None else ("" if not args.gpu else "2,3,4")
        plan = [(2, int(m)) for m in args.modes.split(",") if m]
        plan += [(1, int(m)) for m in ws1.split(",") if m]
        if args.gpu and args.modes == parser.get_default("modes") and args.ws1_modes is None:
            plan = GPU_PLAN  # what the issue asks for first, in case the budget runs out
    runs: dict[tuple[int, int], list[ModeResult]] = {}
    results: list[ModeResult] = []
    failures: list[dict[str, Any]] = []
    try:
        for round_no in range(args.repeat):
            for ws, mode in plan:
                if mode == 1 and round_no:
                    continue  # one sample per case already; K torchruns are the slow part
                label = f"{MODE_LABELS[mode]} ws={ws}"
                if _DEADLINE[0] - time.monotonic() < 30:
                    print(f"bench_cp: {label} skipped: --budget-s spent", flush=True)
                    failures.append({"mode": mode, "world_size": ws, "error": "budget spent"})
                    info["failures"] = failures
                    continue
                print(f"bench_cp: {label} {MODE_NAMES[mode]} ...", flush=True)
                try:
                    if mode == 1:
                        result = mode_torchrun(cases, ws, backend, k, work, logs)
                    elif mode == 2:
                        result = mode_stdio(cases, ws, backend, work, logs, round_no)
                    else:
                        result = mode_pytest(
                            mode,
                            cases_name,
                            n,
                            ws,
                            backend,
                            gpus,
                            work,
                            logs,
                            args.probe,
                            round_no,
                            autoload=args.autoload,
                        )
                except Exception as exc:  # one broken mode must not cost the other numbers
                    print(f"bench_cp: {label} could not be measured: {exc!r}", flush=True)
                    failures.append({"mode": mode, "world_size": ws, "error": repr(exc)})
                    info["failures"] = failures
                    continue
                runs.setdefault((ws, mode), []).append(result)
                print(
                    f"bench_cp: {label}: wall {result.wall_s:.1f} s, spawns "
                    f"{result.group_spawns}, outcomes {result.outcomes}, rc {result.rc}",
                    flush=True,
                )
                results = sorted(
                    (_representative(runs[key]) for key in dict.fromkeys(plan) if key in runs),
                    key=_display_order,
                )
                all_runs = [r.to_json() for key in runs for r in runs[key]]
                _save(json_path, info, results, all_runs)
    finally:
        if args.log_dir is not None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)  # logs live elsewhere; sockets, suites go
    print()
    print(table(results))
    print("\n".join(verdicts(results)))
    print()
    print(warmup_lines(results))
    title = GPU_SECTION if args.gpu else CPU_SECTION
    if args.markdown:
        write_section(args.markdown, title, markdown(title, info, command, results, args.notes))
        print(f"bench_cp: section '{title}' written to {args.markdown}")
    print(f"bench_cp: JSON in {json_path}")
    bad = bool(failures) or any(r.rc != 0 or set(r.outcomes) - {"passed"} for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
