"""Transformer Engine's own CP test file on an H200 pair: TE's stdio pool vs cpq (issue 15).

Runs a subset of TE's ``tests/pytorch/attention/test_attention_with_cp.py`` (fetched into
``.te-tests/`` by ``fetch_te_tests.sh``), as pytest sessions, two ways:

* ``pool``: TE's file as it is: its session fixture spawns one long-lived ``torchrun`` of
  ``run_attention_with_cp_pool.py`` per world size and feeds it one JSON line per case;
* ``cpq``: the same file with ``-p te_anchor_cpq``, which swaps only ``PoolWorker.submit``:
  each case goes to a private cpq broker as ``run_dpa_with_cp(**kwargs)`` with
  ``NVTE_CP_POOL_PG=1``.

Phases (``--phases``, default ``pool,cpq,affinity``), each skipped when the budget cannot fit
it (partial results are written after every session):

1. ``prewarm`` — ``import transformer_engine.pytorch`` once (page cache), not measured;
2. ``pool-cold``, ``pool-second`` — two sessions of TE's pool (each spawns its own pool);
3. ``cpq-cold``, ``cpq-second`` — a fresh broker (default options); the first session
   starts its group, the second finds it warm;
4. ``pool-n2`` — ``-n 2``: two xdist workers, each with its own ws=2 pool on the same two
   GPUs; ``cpq-n2`` — ``-n 2`` on the broker of 3 (one warm ws=2 group, shared);
5. ``aff-*`` — affinity, on a broker with ``--oversubscribe --spares 0`` and two ws=2
   groups on the same two GPUs: ``aff-spread`` (``-n 2``: the cases spread over both
   groups), then ``aff-on`` (one worker, per-case affinity keys: with both groups idle,
   each case goes back to the group that ran it) and ``aff-off`` (no keys: every case goes
   to the most recently used group, so about half land on a group that never ran them).

Every session's verdicts are compared case by case with ``pool-cold``'s. Per-case times
come from pytest's JUnit XML (setup + call + teardown, as pytest reports them); TE's pool
also prints its in-pool time (``NVTE_CP_POOL_TIMING=1``), cpq's adapter logs the broker's
task duration and the group that ran each case.

Usage::

    python tools/gpu/te_anchor/run_anchor.py --budget-s 540    # the GPU host (anchor.sh)
    python tools/gpu/te_anchor/run_anchor.py --phases affinity,pool1 --cases affinity
    python tools/gpu/te_anchor/run_anchor.py --selftest        # CPU: fake_te/, gloo
    python tools/gpu/te_anchor/run_anchor.py --report FILE     # print a result's tables
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]  # cpq and benchkit, run from anywhere

from benchkit import PrivateBroker, child_env, run_logged  # noqa: E402

TEST_FILE = "tests/pytorch/attention/test_attention_with_cp.py"
FUSED = "test_cp_with_fused_attention"


def fused_id(model: str, fmt: str, comm: str, dtype: str = "bf16", fp8: str = "") -> str:
    """TE's fused test id: f16_O-scaling_mode-fp8_dpa-fp8_mha-fp8_bwd-comm-format-model-dtype
    (pytest joins stacked parametrize ids innermost first)."""
    head = fp8 or "True-None-False-False-False"
    return f"{FUSED}[{head}-{comm}-{fmt}-{model}-{dtype}]"


#: The subset: 12 bf16 FusedAttention cases over formats, comm types and model families
#: (MHA, GQA, sliding window, bias, MLA, learnable softmax) and one FP8 (delayed scaling)
#: case; all ws=2 (TE routes a2a+p2p to a ws=4 pool, which a pair cannot run).
TE_CASES = [
    fused_id("cp_1_0", "sbhd", "p2p"),
    fused_id("cp_1_0", "sbhd", "all_gather"),
    fused_id("cp_1_0", "sbhd", "a2a"),
    fused_id("cp_1_0", "thd", "p2p"),
    fused_id("cp_1_0", "thd", "a2a"),
    fused_id("cp_2_0", "sbhd", "p2p"),
    fused_id("cp_2_0", "sbhd", "a2a"),
    fused_id("cp_2_0", "thd", "p2p"),
    fused_id("cp_2_1", "sbhd", "all_gather"),
    fused_id("cp_2_2", "sbhd", "p2p"),
    fused_id("cp_3_1", "sbhd", "p2p"),
    fused_id("cp_4_2", "sbhd", "a2a"),
    fused_id("cp_1_0", "sbhd", "p2p", "fp8", "False-delayed-True-False-False"),
]

#: The affinity run's cases (second GPU call): the sbhd cases that ran on the pair in the
#: first call, without cp_3_1 (19 s of CPU-side input generation per case, warm or not),
#: plus the other sbhd ones the first call did not try, and one FP8 case that has no
#: max-logit (cp_1_0's FP8 case found no backend with cuDNN 9.14).
AFF_CASES = [
    fused_id("cp_2_0", "sbhd", "p2p"),
    fused_id("cp_2_0", "sbhd", "a2a"),
    fused_id("cp_2_0", "sbhd", "all_gather"),
    fused_id("cp_2_1", "sbhd", "all_gather"),
    fused_id("cp_2_1", "sbhd", "a2a"),
    fused_id("cp_4_2", "sbhd", "a2a"),
    fused_id("cp_4_3", "sbhd", "a2a"),
    fused_id("cp_2_0", "sbhd", "p2p", "fp8", "False-delayed-True-False-False"),
]

#: The stand-in's ids: test_cp_with_fused_attention[comm-format-model-dtype].
SELFTEST_CASES = [
    f"{FUSED}[{comm}-{fmt}-{model}-bf16]"
    for model in ("cp_a", "cp_b", "cp_bad")
    for fmt in ("sbhd", "thd")
    for comm in ("p2p", "a2a")
]


@dataclass
class Profile:
    name: str
    te_path: Path
    cases: list[str]
    broker_gpus: str
    broker_extra: list[str] = field(default_factory=list)
    preload: str = "transformer_engine.pytorch"
    prewarm: str = "import torch, transformer_engine.pytorch; torch.cuda.init()"


def te_profile(te_path: Path, cases: str) -> Profile:
    return Profile("te", te_path, AFF_CASES if cases == "affinity" else TE_CASES, "auto")


def selftest_profile() -> Profile:
    # gloo groups on two cores: no spares (they would be more processes on the same cores)
    return Profile(
        "selftest",
        HERE / "fake_te",
        SELFTEST_CASES,
        "none",
        ["--spares", "0"],
        preload="",
        prewarm="import torch",
    )


# --------------------------------------------------------------------------------------
# Budget, logging, results
# --------------------------------------------------------------------------------------


class Budget:
    def __init__(self, total_s: float) -> None:
        self.total, self.start = total_s, time.monotonic()

    def left(self) -> float:
        return self.total - (time.monotonic() - self.start)


def log(message: str) -> None:
    print(f"[anchor {time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_json(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    tmp.replace(path)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    for name in ("torch", "transformer_engine", "transformer_engine_torch", "pyzmq", "pytest"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[name] = importlib.metadata.version(name)
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
            gpus = [g.strip() for g in out.splitlines() if g.strip()]
            info["gpus"] = f"{len(gpus)}x {gpus[0]}" if gpus else ""
    return info


# --------------------------------------------------------------------------------------
# One pytest session
# --------------------------------------------------------------------------------------

_POOL_TIMING = re.compile(r"\[POOL-TIMING\].*?wall_s=([0-9.]+)")


def parse_junit(path: Path) -> dict[str, dict[str, Any]]:
    """Per test (by its name with parameters): outcome, time, TE's in-pool time."""
    tests: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return tests
    with contextlib.suppress(ET.ParseError):
        for case in ET.parse(path).getroot().iter("testcase"):
            outcome, message, pool_s = "passed", "", None
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed" if child.tag == "failure" else "error"
                    message = (child.get("message") or "")[:300]
                elif child.tag == "skipped":
                    outcome, message = "skipped", (child.get("message") or "")[:300]
                elif child.tag == "system-err":
                    found = _POOL_TIMING.findall(child.text or "")
                    pool_s = float(found[-1]) if found else None
            tests[case.get("name", "")] = {
                "outcome": outcome,
                "time_s": round(float(case.get("time") or 0.0), 3),
                "pool_case_s": pool_s,
                "message": message,
            }
    return tests


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


class Runner:
    def __init__(self, profile: Profile, work: Path, budget: Budget) -> None:
        self.profile, self.work, self.budget = profile, work, budget
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        env = child_env(repo_first=False)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, str(HERE)]))
        env["TE_PATH"] = str(profile.te_path)
        env["NVTE_CP_POOL_TIMING"] = "1"
        env["TE_ANCHOR_PRELOAD"] = profile.preload
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # xdist and the adapter by -p only
        for key in ("NVTE_CP_POOL_PG", "TE_ANCHOR_LOG", "TE_ANCHOR_AFFINITY", "TE_ANCHOR_WARM"):
            env.pop(key, None)
        self.env = env

    def broker(self, name: str, extra: list[str]) -> PrivateBroker:
        state = Path(tempfile.mkdtemp(prefix=f"cpq-{name}-", dir=self.work))
        return PrivateBroker(
            state,
            self.logs / f"broker-{name}",
            self.profile.broker_gpus,
            self.env,
            tuple([*self.profile.broker_extra, *extra]),
        )

    def session(
        self,
        name: str,
        mode: str,
        *,
        broker: PrivateBroker | None = None,
        workers: int = 0,
        extra_env: dict[str, str] | None = None,
        limit: float = 300.0,
    ) -> dict[str, Any]:
        """One pytest session over the subset; its wall, verdicts and per-case times."""
        junit = self.logs / f"{name}.xml"
        adapter_log = self.logs / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd += ["-o", "junit_logging=system-err", f"--junitxml={junit}"]
        if workers:
            cmd += ["-p", "xdist.plugin", "-n", str(workers)]
        env = dict(self.env)
        if mode == "cpq":
            assert broker is not None
            cmd += ["-p", "te_anchor_cpq"]
            env.update(broker.env, CPQ_AUTOSTART="0", TE_ANCHOR_LOG=str(adapter_log))
        env.update(extra_env or {})
        cmd += [f"{TEST_FILE}::{case}" for case in self.profile.cases]
        limit = max(min(limit, self.budget.left() - 10), 5.0)
        log(f"{name}: {mode}, workers {workers or 1}, limit {limit:.0f} s")
        run = run_logged(cmd, self.logs / f"{name}.log", env, self.profile.te_path, limit)
        tests = parse_junit(junit)
        records = read_jsonl(adapter_log)
        for record in records:
            case = record.get("test", "").rpartition("::")[2]
            if case in tests:
                tests[case]["cpq"] = {
                    k: record.get(k)
                    for k in ("group", "attempts", "queue_s", "duration_s", "case_s", "worker")
                }
        counts = {k: sum(t["outcome"] == k for t in tests.values()) for k in _OUTCOMES}
        times = [tests[c]["time_s"] for c in self.profile.cases if c in tests]
        ran = passed_times(tests, self.profile.cases)
        out = {
            "name": name,
            "mode": mode,
            "workers": workers or 1,
            "command": shlex.join(["python", *cmd[1:]]),
            "rc": run.rc,
            "wall_s": round(run.wall_s, 3),
            "counts": counts,
            "sum_case_s": round(sum(times), 3),
            "first_case_s": ran[0] if ran else None,  # of the cases that passed
            "median_case_s": round(statistics.median(ran), 3) if ran else None,
            "tests": tests,
            "extra_env": extra_env or {},
        }
        log(f"{name}: rc {run.rc}, wall {run.wall_s:.1f} s, {counts}")
        if run.rc not in (0, 1):
            log(f"{name}: log tail:\n{tail(self.logs / f'{name}.log')}")
        return out


_OUTCOMES = ("passed", "failed", "skipped", "error")


def passed_times(tests: dict[str, dict[str, Any]], order: list[str]) -> list[float]:
    """JUnit times of the cases that passed, in session order (skips cost ~0 s and a case
    failing in the pytest process never reached a worker)."""
    return [tests[c]["time_s"] for c in order if tests.get(c, {}).get("outcome") == "passed"]


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


def pool_summary(broker: PrivateBroker) -> list[dict[str, Any]]:
    try:
        status = broker.status()
    except Exception as exc:  # a status is a nice-to-have
        return [{"error": f"{type(exc).__name__}: {exc}"}]
    keys = ("id", "gpus", "state", "ready_after_s", "tasks_done", "spare")
    return [{k: p.get(k) for k in keys} for p in status.get("pools", [])]


# --------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------

#: Rough minimum seconds a phase needs on the H200 pair (TE import in pytest ~10 s, a
#: pool/group start ~15 s, cold cases of new configurations 1-9 s each).
NEED = {"pool": 80, "cpq-cold": 90, "cpq-second": 40, "n2": 80, "aff": 150}


def run_all(
    profile: Profile, work: Path, budget: Budget, out_json: Path, phases: list[str]
) -> dict[str, Any]:
    results: dict[str, Any] = {
        "profile": profile.name,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "te_path": str(profile.te_path),
        "cases": profile.cases,
        "phases": phases,
        "sessions": {},
        "skipped_phases": [],
    }
    runner = Runner(profile, work, budget)
    sessions: dict[str, Any] = results["sessions"]

    def save() -> None:
        write_json(out_json, results)

    def fits(phase: str, need: float) -> bool:
        if budget.left() >= need:
            return True
        results["skipped_phases"].append(f"{phase} (needs ~{need:.0f} s, {budget.left():.0f} left)")
        log(f"skipping {phase}: {budget.left():.0f} s left")
        save()
        return False

    scale = 0.3 if profile.name == "selftest" else 1.0

    # 1. page cache: the first process on a fresh machine pays for reading the libraries
    started = time.perf_counter()
    run = run_logged(
        [sys.executable, "-c", profile.prewarm],
        runner.logs / "prewarm.log",
        runner.env,
        ROOT,
        120,
    )
    results["prewarm"] = {"rc": run.rc, "wall_s": round(time.perf_counter() - started, 2)}
    log(f"prewarm: rc {run.rc}, {results['prewarm']['wall_s']} s")
    save()

    for phase in phases:
        if phase == "pool":  # TE's own pool, two sessions (each spawns its pool)
            for name in ("pool-cold", "pool-second"):
                if fits(name, NEED["pool"] * scale):
                    sessions[name] = runner.session(name, "pool", limit=240)
                    save()
        elif phase == "pool1":  # one session of TE's pool (verdicts for another case set)
            if fits("pool-cold", NEED["pool"] * scale):
                sessions["pool-cold"] = runner.session("pool-cold", "pool", limit=240)
                save()
        elif phase == "cpq":
            phase_cpq(runner, results, fits, save, scale)
        elif phase == "affinity":
            phase_affinity(runner, results, fits, save, scale)
        else:
            raise ValueError(f"unknown phase {phase!r}")

    results["verdicts"] = compare_verdicts(results)
    results["affinity"] = affinity_summary(results)
    results["budget_left_s"] = round(budget.left(), 1)
    save()
    return results


def phase_cpq(runner: Runner, results: dict[str, Any], fits: Any, save: Any, scale: float) -> None:
    """A fresh broker (default options): cold then second session; then ``-n 2`` for TE's
    pool (one pool per xdist worker) and for cpq (the warm group, shared)."""
    sessions = results["sessions"]
    if not fits("cpq-cold", NEED["cpq-cold"] * scale):
        return
    main_broker = runner.broker("main", [])
    results["main_broker"] = {"start_s": round(main_broker.start_s, 3), "options": "default"}
    try:
        sessions["cpq-cold"] = runner.session("cpq-cold", "cpq", broker=main_broker, limit=240)
        save()
        if fits("cpq-second", NEED["cpq-second"] * scale):
            sessions["cpq-second"] = runner.session(
                "cpq-second", "cpq", broker=main_broker, limit=200
            )
            save()
        if fits("pool-n2", NEED["n2"] * scale):
            sessions["pool-n2"] = runner.session("pool-n2", "pool", workers=2, limit=200)
            save()
        if fits("cpq-n2", NEED["n2"] * 0.5 * scale):
            sessions["cpq-n2"] = runner.session(
                "cpq-n2", "cpq", broker=main_broker, workers=2, limit=150
            )
            save()
        results["main_broker"]["pools"] = pool_summary(main_broker)
    finally:
        main_broker.stop()
    save()


def phase_affinity(
    runner: Runner, results: dict[str, Any], fits: Any, save: Any, scale: float
) -> None:
    """Two groups of one spec on the same two GPUs: spread the cases over both (-n 2),
    then one worker with per-case affinity keys, then one without."""
    sessions = results["sessions"]
    if not fits("affinity", NEED["aff"] * scale):
        return
    aff = runner.broker("affinity", ["--oversubscribe", "--spares", "0"])
    results["affinity_broker"] = {
        "start_s": round(aff.start_s, 3),
        "options": "--oversubscribe --spares 0",
    }
    try:
        sessions["aff-spread"] = runner.session(
            "aff-spread",
            "cpq",
            broker=aff,
            workers=2,
            extra_env={"TE_ANCHOR_WARM": "2", "TE_ANCHOR_AFFINITY": "case"},
            limit=220,
        )
        save()
        for name, mode in (("aff-on", "case"), ("aff-off", "none")):
            if fits(name, 45 * scale):
                sessions[name] = runner.session(
                    name,
                    "cpq",
                    broker=aff,
                    extra_env={"TE_ANCHOR_WARM": "0", "TE_ANCHOR_AFFINITY": mode},
                    limit=150,
                )
                save()
        results["affinity_broker"]["pools"] = pool_summary(aff)
    finally:
        aff.stop()
    save()


# --------------------------------------------------------------------------------------
# Analysis and tables
# --------------------------------------------------------------------------------------


def compare_verdicts(results: dict[str, Any]) -> dict[str, Any]:
    """Every session's outcome per case against pool-cold's (TE's own pool)."""
    sessions = results.get("sessions", {})
    base = sessions.get("pool-cold", {}).get("tests", {})
    out: dict[str, Any] = {"reference": "pool-cold", "per_session": {}}
    for name, sess in sessions.items():
        tests = sess.get("tests", {})
        diff = {
            case: {"pool-cold": base.get(case, {}).get("outcome"), name: t.get("outcome")}
            for case, t in tests.items()
            if base and base.get(case, {}).get("outcome") != t.get("outcome")
        }
        missing = [c for c in results.get("cases", []) if c not in tests]
        out["per_session"][name] = {
            "identical": (not diff and not missing) if base else None,  # None: no reference
            "differences": diff,
            "missing": missing,
        }
    return out


def affinity_summary(results: dict[str, Any]) -> dict[str, Any]:
    """For aff-on and aff-off: did each case run on the group that ran it in aff-spread,
    and what did the cases that moved cost against those that stayed?"""
    sessions = results.get("sessions", {})
    spread = sessions.get("aff-spread", {}).get("tests", {})
    first_group = {c: t.get("cpq", {}).get("group") for c, t in spread.items()}
    out: dict[str, Any] = {}
    for name in ("aff-on", "aff-off"):
        tests = sessions.get(name, {}).get("tests", {})
        if not tests:
            continue
        stayed, moved = [], []
        for case, t in tests.items():
            if t.get("outcome") != "passed" or not first_group.get(case):
                continue
            group = t.get("cpq", {}).get("group")
            case_s = t.get("cpq", {}).get("case_s")
            row = (t["time_s"], case_s if case_s is not None else t["time_s"])
            (stayed if group == first_group[case] else moved).append(row)
        out[name] = {
            "wall_s": sessions[name].get("wall_s"),
            "cases_on_their_group": len(stayed),
            "cases_moved": len(moved),
            "stayed_sum_s": round(sum(r[0] for r in stayed), 3),
            "moved_sum_s": round(sum(r[0] for r in moved), 3),
            "stayed_median_s": _median([r[0] for r in stayed]),
            "moved_median_s": _median([r[0] for r in moved]),
            "stayed_rank_case_s": [r[1] for r in stayed],
            "moved_rank_case_s": [r[1] for r in moved],
            "sum_case_s": sessions[name].get("sum_case_s"),
        }
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _yes(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "NO"


def _f(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def short(case: str) -> str:
    inner = case[case.find("[") + 1 : -1]
    parts = inner.split("-")
    return "-".join(parts[-4:]) if len(parts) >= 4 else inner


def render(results: dict[str, Any]) -> str:
    sessions = results.get("sessions", {})
    lines = [
        f"profile {results.get('profile')}, {results.get('date')}, {results.get('machine')}",
        "",
        "| session | mode | workers | wall s | passed / failed / skipped / error "
        "| sum of case s | first passed case s | median passed case s | verdicts = pool-cold |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    verdicts = results.get("verdicts", {}).get("per_session", {})
    for name, s in sessions.items():
        ran = passed_times(s.get("tests", {}), results.get("cases", []))
        s = dict(s, first_case_s=ran[0] if ran else None)
        s["median_case_s"] = round(statistics.median(ran), 3) if ran else None
        c = s.get("counts", {})
        counts = " / ".join(str(c.get(k, 0)) for k in _OUTCOMES)
        same = verdicts.get(name, {}).get("identical")
        lines.append(
            f"| {name} | {s.get('mode')} | {s.get('workers')} | {_f(s.get('wall_s'), 1)} "
            f"| {counts} | {_f(s.get('sum_case_s'), 1)} | {_f(s.get('first_case_s'))} "
            f"| {_f(s.get('median_case_s'))} | {_yes(same)} |"
        )
    names = [n for n in sessions if n in ("pool-cold", "pool-second", "cpq-cold", "cpq-second")]
    if names:
        lines += ["", "Per case, seconds (JUnit time; outcome if not passed):", ""]
        lines.append("| case | " + " | ".join(names) + " |")
        lines.append("| --- |" + " --- |" * len(names))
        for case in results.get("cases", []):
            cells = []
            for n in names:
                t = sessions[n].get("tests", {}).get(case)
                if t is None:
                    cells.append("-")
                elif t["outcome"] == "passed":
                    cells.append(_f(t["time_s"]))
                else:
                    cells.append(f"{t['outcome']} {_f(t['time_s'])}")
            lines.append(f"| {short(case)} | " + " | ".join(cells) + " |")
    aff = results.get("affinity", {})
    if aff:
        lines += [
            "",
            "| affinity session | wall s | cases on the group that ran them | moved "
            "| median s stayed | median s moved | sum s moved |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, a in aff.items():
            lines.append(
                f"| {name} | {_f(a.get('wall_s'), 1)} | {a.get('cases_on_their_group')} "
                f"| {a.get('cases_moved')} | {_f(a.get('stayed_median_s'))} "
                f"| {_f(a.get('moved_median_s'))} | {_f(a.get('moved_sum_s'))} |"
            )
    aff_names = [n for n in ("aff-spread", "aff-on", "aff-off") if n in sessions]
    if aff_names:
        lines += ["", "Affinity, per case: group / JUnit s / rank-side case s:", ""]
        lines.append("| case | " + " | ".join(aff_names) + " |")
        lines.append("| --- |" + " --- |" * len(aff_names))
        for case in results.get("cases", []):
            cells = []
            for n in aff_names:
                t = sessions[n].get("tests", {}).get(case)
                if t is None:
                    cells.append("-")
                    continue
                c = t.get("cpq") or {}
                text = f"{c.get('group', '-')} / {_f(t['time_s'])} / {_f(c.get('case_s'))}"
                cells.append(text if t["outcome"] == "passed" else f"{t['outcome']} {text}")
            lines.append(f"| {short(case)} | " + " | ".join(cells) + " |")
    for diff_name, v in verdicts.items():
        if v.get("differences") or v.get("missing"):
            diff, missing = v.get("differences"), v.get("missing")
            lines.append(f"{diff_name}: differences {diff} missing {missing}")
    if results.get("skipped_phases"):
        lines.append(f"skipped phases: {results['skipped_phases']}")
    return "\n".join(lines)


def pack_logs(work: Path, dest: Path, max_bytes: int = 10 * 2**20) -> None:
    files = sorted(p for p in (work / "logs").rglob("*") if p.is_file())
    with tarfile.open(dest, "w:gz") as tar:
        for path in files:
            if path.stat().st_size < max_bytes // 2:
                tar.add(path, arcname=str(path.relative_to(work)))


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--selftest", action="store_true", help="CPU stand-in (fake_te/), gloo")
    parser.add_argument("--te-path", type=Path, default=ROOT / ".te-tests")
    parser.add_argument("--budget-s", type=float, default=None, help="default 540; selftest 400")
    parser.add_argument("--json", type=Path, help="results (default $OUT/te_anchor.json)")
    parser.add_argument("--logs-tar", type=Path, help="logs tarball (default $OUT/...)")
    parser.add_argument("--work", type=Path, help="work dir (default: a temp dir)")
    parser.add_argument("--report", type=Path, help="print the tables of an earlier result")
    parser.add_argument(
        "--phases",
        default="pool,cpq,affinity",
        help="comma-separated, in order: pool (2 sessions), pool1 (1 session), cpq (cold, "
        "second, pool -n 2, cpq -n 2), affinity (default pool,cpq,affinity)",
    )
    parser.add_argument(
        "--cases", choices=("subset", "affinity"), default="subset", help="TE case set"
    )
    args = parser.parse_args(argv)
    if args.report:
        print(render(json.loads(args.report.read_text())))
        return 0
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="te-anchor-out-"))
    out_json = args.json or out_dir / "te_anchor.json"
    logs_tar = args.logs_tar or out_dir / "te_anchor_logs.tar.gz"
    if args.selftest:
        profile = selftest_profile()
    else:
        profile = te_profile(args.te_path.resolve(), args.cases)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not (profile.te_path / TEST_FILE).exists():
        print(f"{profile.te_path / TEST_FILE} missing: run tools/gpu/te_anchor/fetch_te_tests.sh")
        return 2
    budget = Budget(args.budget_s or (400.0 if args.selftest else 540.0))
    work = args.work or Path(tempfile.mkdtemp(prefix="te-anchor-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"profile {profile.name}, work {work}, results {out_json}, budget {budget.total:.0f} s")
    try:
        results = run_all(profile, work, budget, out_json, phases)
    finally:
        with contextlib.suppress(OSError):
            pack_logs(work, logs_tar)
    print(render(results), flush=True)
    per_session = results.get("verdicts", {}).get("per_session", {})
    ok = all(v.get("identical") is not False for v in per_session.values())
    return 0 if ok and results.get("sessions") else 1


if __name__ == "__main__":
    sys.exit(main())
