"""Benchmark (issue 8): Transformer Engine CP attention on an H200 pair, torchrun per case vs cpq.

Why this exists: TE's context-parallel attention matrix is the suite cpq was built for. Run
the old way, every case is its own ``torchrun`` (~30 s on an H200 pair, almost all of it
process start, imports, NCCL set-up, kernel warm-up and teardown, for ~0.1 s of checking);
under cpq the 24 cases share one warm group. One run of this script, on the GPU host, makes
the table that says how much that saves and where the torchrun time goes:

1. ``reset``: on a fresh broker, ``cpq.Client`` submits case 0 first on a fresh group, then
   ``--reset-others`` other cases, then case 0 again, and compares the two results (TE's max
   errors): a warm rank's state reset makes the case independent of what ran before it.
   ``state_fingerprint`` (TE's FP8 flags, attention-backend cache, NVTE_* variables) is read
   after the first case and after the last. This phase goes first on purpose: the first
   process on a fresh machine pays one-off costs (~6 s more first-case warm-up, per
   tools/gpu/README.md) that belong to neither mode of the comparison.
2. ``cpq``: a fresh broker (``--gpus auto``, its own ``CPQ_STATE_DIR`` and ``CPQ_ENDPOINT``)
   and ``python -m pytest -p cpq.client.plugin tests/gpu/test_te_cp_attention.py -k "not
   test_te_cp_ws4"`` (the 24 ws=2 cases): wall, per-test times (JUnit XML), and the broker's
   ``Client.status()`` snapshot (groups started, each pool's ``ready_after_s``) after it.
3. ``torchrun``: ``--k`` cases (default 6, the representative ones of te_standalone.py), each
   a full ``python -m torch.distributed.run --standalone --nproc-per-node 2
   tools/gpu/te_standalone.py --cases <index>``: wall per case, split with the driver's
   per-rank epoch stamps into launch, ``import torch``, CUDA device set-up, ``import
   transformer_engine.pytorch``, process group, the case (with an estimate of its kernel /
   cuDNN warm-up), and teardown. This phase fills what is left of ``--budget-s``.

Definitions: ``wall`` is what the user waits for (the ``pytest`` process; the sum of the
``torchrun`` processes, extrapolated to 24 cases from the measured mean); the broker's own
start is reported but not in ``wall``. ``ratio`` = (torchrun mean per case x cases) / wall.

Everything is started as ``sys.executable -m ...`` (no console scripts): on the GPU host cpq
is on ``PYTHONPATH`` (``/tmp/site:<repo>``), not installed, so the plugin is loaded with
``-p cpq.client.plugin`` when no ``pytest11`` entry point provides it.

Usage::

    python tools/bench_te.py                          # on the H200 pair (tools/gpu/final.sh)
    python tools/bench_te.py --selftest               # CPU: same plumbing, gloo, no TE
    python tools/bench_te.py --report results.json    # print the table of an earlier run

``--selftest`` swaps the workload for ``workers.cp_attention`` (the plain-torch CP attention,
24 tiny fp32 cases, gloo, broker ``--gpus none``) and the torchrun driver for a tiny one in
this file (``--driver``) that writes te_standalone.py's JSON, so every code path but TE's
runs on a CPU machine.
"""

from __future__ import annotations

import time

_T_MAIN = time.time()  # the --driver mode's script start (before its other imports)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime as _dt  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import xml.etree.ElementTree as ET  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchkit import PrivateBroker, child_env, run_logged  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "tools" / "results" / "bench_te_gpu.json"
# The 24 ws=2 cases; the ws=4 ones (skipped on a pair) are deselected. Not a node id
# (``::test_te_cp``): without TE the module skips and a node id would then be a usage error.
TE_TEST = ["tests/gpu/test_te_cp_attention.py", "-k", "not test_te_cp_ws4"]
FINGERPRINT = "workers.te_attention:state_fingerprint"  # works without TE too
WORLD_SIZE = 2

# One torchrun's wall, split at the driver's epoch stamps (rank 0). ``None``: torchrun's exit.
SEGMENTS: list[tuple[str, str | None, str]] = [
    ("launch", "script_start", "torchrun launch -> driver script starts"),
    ("import_torch", "torch_imported", "import torch"),
    ("cuda_init", "cuda_device_set", "torch.cuda.set_device (CUDA context)"),
    ("import_te", "te_imported", "import transformer_engine.pytorch"),
    ("process_group", "process_group_ready", "init_process_group + first barrier"),
    ("prepare", "cases_start", "import workers, state fingerprint"),
    ("case", "cases_end", "the case (warm-up + check + timed steps)"),
    ("teardown", None, "report, destroy_process_group, exit, torchrun exit"),
]


# --------------------------------------------------------------------------------------
# Profiles: the TE workload on GPUs, or the plain-torch stand-in on CPU (--selftest)
# --------------------------------------------------------------------------------------


@dataclass
class Profile:
    """What the three phases run; the TE one on the H200 pair, the selftest one on CPU."""

    name: str
    target: str
    cases: list[dict[str, Any]]
    ids: list[str]
    group_env: dict[str, str]  # the pool spec's env for the reset phase (as the GPU tests use)
    broker_gpus: str
    torchrun_order: list[int]  # case indices, in the order the torchrun phase runs them
    torchrun_script: Path
    import_label: str  # what the driver's "import_te" segment imports
    pytest_args: list[str]  # what to run, relative to pytest_cwd
    pytest_cwd: Path


def te_profile() -> Profile:
    from workers import te_attention  # CPU-safe: imports neither torch nor TE at module level

    ids = [te_attention.case_id(c) for c in te_attention.CASES]
    standalone = _load_te_standalone()
    representative: list[str] = list(getattr(standalone, "REPRESENTATIVE", []))
    order = [ids.index(i) for i in representative if i in ids]
    order += [i for i in range(len(ids)) if i not in order]
    return Profile(
        name="te",
        target="workers.te_attention:run_dpa_with_cp",
        cases=list(te_attention.CASES),
        ids=ids,
        group_env={"CPQ_PRELOAD": "transformer_engine.pytorch"},
        broker_gpus="auto",
        torchrun_order=order,
        torchrun_script=ROOT / "tools" / "gpu" / "te_standalone.py",
        import_label="import transformer_engine.pytorch",
        pytest_args=TE_TEST,
        pytest_cwd=ROOT,
    )


def _load_te_standalone() -> Any:
    path = ROOT / "tools" / "gpu" / "te_standalone.py"
    spec = importlib.util.spec_from_file_location("_te_standalone", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SELFTEST_TESTS = '''"""Generated by tools/bench_te.py --selftest: the stand-in for the TE matrix."""
from typing import Any

import pytest

from workers.cp_attention import CASES, case_id


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_cp(cpq: Any, case: dict[str, Any]) -> None:
    cpq.run("workers.cp_attention:run_cp_attention", world_size=2,
            env={{"CPQ_PRELOAD": "workers.cp_attention"}}, **case)
'''


def selftest_profile(work: Path) -> Profile:
    from workers import cp_attention

    suite = work / "selftest_suite"
    suite.mkdir(exist_ok=True)
    (suite / "pytest.ini").write_text("[pytest]\naddopts =\n")  # rootdir here, not the repo's
    (suite / "test_selftest_cp.py").write_text(SELFTEST_TESTS.format())
    return Profile(
        name="selftest",
        target="workers.cp_attention:run_cp_attention",
        cases=list(cp_attention.CASES),
        ids=[cp_attention.case_id(c) for c in cp_attention.CASES],
        group_env={"CPQ_PRELOAD": "workers.cp_attention"},
        broker_gpus="none",
        torchrun_order=list(range(len(cp_attention.CASES))),
        torchrun_script=Path(__file__).resolve(),
        import_label="import workers.cp_attention (stand-in for TE)",
        pytest_args=["test_selftest_cp.py"],
        pytest_cwd=suite,
    )


# --------------------------------------------------------------------------------------
# --driver: the selftest's torchrun driver (te_standalone.py's JSON, gloo, no TE)
# --------------------------------------------------------------------------------------


def driver_main(argv: list[str]) -> int:
    """One ``workers.cp_attention`` case under torchrun, written like te_standalone.py."""
    parser = argparse.ArgumentParser(prog="bench_te.py --driver")
    parser.add_argument("--cases", required=True, help="one case index")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    stamps: dict[str, float] = {"script_start": _T_MAIN}
    marks: dict[str, float] = {}
    t = time.perf_counter()
    import torch.distributed as dist

    marks["import_torch_s"] = time.perf_counter() - t
    stamps["torch_imported"] = stamps["cuda_device_set"] = time.time()
    t = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    from workers import cp_attention as w

    marks["import_te_s"] = time.perf_counter() - t
    stamps["te_imported"] = time.time()
    t = time.perf_counter()
    dist.init_process_group("gloo")
    dist.barrier()
    marks["init_process_group_s"] = time.perf_counter() - t
    stamps["process_group_ready"] = time.time()
    case = w.CASES[int(args.cases)]
    stamps["cases_start"] = time.time()
    t = time.perf_counter()
    row: dict[str, Any] = {"case": w.case_id(case)}
    try:
        row.update(outcome="passed", value=w.run_cp_attention(**case))
    except Exception as exc:
        row.update(outcome="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
    row["wall_s"] = round(time.perf_counter() - t, 3)
    stamps["cases_end"] = time.time()
    world = dist.get_world_size()
    all_marks: list[Any] = [None] * world
    all_stamps: list[Any] = [None] * world
    dist.all_gather_object(all_marks, marks)
    dist.all_gather_object(all_stamps, stamps)
    if dist.get_rank() == 0:
        t0 = float(os.environ.get("TE_STANDALONE_T0") or -1)
        data = {"marks": all_marks, "rows": [row], "repeat": None, "stamps": all_stamps, "t0": t0}
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if row["outcome"] == "passed" else 1


# --------------------------------------------------------------------------------------
# Process helpers
# --------------------------------------------------------------------------------------


class Budget:
    """The run's time budget: phases ask what is left before they start more work."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()


def log(message: str) -> None:
    print(f"[bench_te {time.strftime('%H:%M:%S')}] {message}", flush=True)


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


def plugin_args() -> list[str]:
    """``-p cpq.client.plugin`` unless a ``pytest11`` entry point already loads it (loading the
    module under two names would make pytest refuse it)."""
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return ["-p", "cpq.client.plugin"]
    installed = any(ep.name == "cpq" for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "cpq.client.plugin"]


def private_broker(work: Path, name: str, gpus: str, env: dict[str, str]) -> PrivateBroker:
    state = Path(tempfile.mkdtemp(prefix=f"cpq-{name}-", dir=work))
    return PrivateBroker(state, work / "logs" / f"broker-{name}", gpus, env)


def pool_summary(status: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ("id", "spec", "gpus", "state", "ready_after_s", "tasks_done", "env")
    return [{k: p.get(k) for k in keys} for p in status.get("pools", [])]


# --------------------------------------------------------------------------------------
# Phase: reset check (cpq.Client, fresh group)
# --------------------------------------------------------------------------------------


def max_errors(value: Any) -> dict[str, float]:
    """The max-error numbers of a case's return value (TE's or the plain-torch one's)."""
    if not isinstance(value, dict):
        return {}
    if isinstance(value.get("max_abs_err"), dict):
        return dict(value["max_abs_err"])
    return {k: v for k, v in value.items() if k.endswith("_max_abs_err")}


def _task_row(label: str, result: Any, rtt: float) -> dict[str, Any]:
    durations = [r.duration_s for r in result.ranks]
    row: dict[str, Any] = {
        "label": label,
        "outcome": result.outcome,
        "round_trip_s": round(rtt, 4),
        "duration_s": round(max(durations), 4) if durations else None,
        "group_id": result.group_id,
        "attempts": result.attempts,
        "value": result.value,
    }
    if result.outcome != "passed":
        first = next((r for r in result.ranks if r.error is not None), None)
        row["message"] = (result.message or "")[:1000]
        if result.outcome != "skipped" and first is not None and first.error is not None:
            row["error"] = (first.error.traceback or first.error.message)[-3000:]
    return row


# What may differ between two fingerprints of a healthy group: memory held by caches, and the
# backend selector's record of the last case (harmless while it is marked stale before a task).
VOLATILE_FINGERPRINT = {
    "cuda_allocated",
    "attention_backends.last_selected",
    "attention_backends.attention_params",
}


def _flatten(fingerprint: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in fingerprint.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{sub}": v for sub, v in value.items()})
        else:
            flat[key] = value
    return flat


def phase_reset(
    profile: Profile, work: Path, env: dict[str, str], budget: Budget, others: int, reserve: float
) -> dict[str, Any]:
    """Case 0 first on a fresh group, ``others`` cases, case 0 again: same max errors?"""
    from cpq import Client

    broker = private_broker(work, "reset", profile.broker_gpus, env)
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"broker_start_s": round(broker.start_s, 3), "ok": False}
    t_phase = time.perf_counter()
    try:
        with Client(broker.endpoint, name="bench_te-reset") as client:

            def submit(label: str, target: str, kwargs: dict[str, Any]) -> dict[str, Any]:
                wait = max(budget.left() - reserve / 2, min(30.0, budget.left()), 1.0)
                start = time.perf_counter()
                future = client.submit_async(
                    target,
                    WORLD_SIZE,
                    kwargs,
                    timeout=180.0,
                    env=profile.group_env,
                    test_id=f"bench_te::{label}",
                    roots=[str(ROOT)],
                )
                row = _task_row(label, future.result(timeout=wait), time.perf_counter() - start)
                rows.append(row)
                log(f"reset: {label}: {row['outcome']} {row['duration_s']} s")
                return row

            first = submit(f"first {profile.ids[0]}", profile.target, profile.cases[0])
            fp_first = submit("fingerprint after first", FINGERPRINT, {})
            ran = 0
            for index in range(1, min(others, len(profile.cases) - 1) + 1):
                if budget.left() < reserve:
                    log(f"reset: budget: {ran} of {others} other cases run")
                    break
                submit(profile.ids[index], profile.target, profile.cases[index])
                ran += 1
            again = submit(f"again {profile.ids[0]}", profile.target, profile.cases[0])
            fp_last = submit("fingerprint after all", FINGERPRINT, {})
            out["status"] = client.status()
        t_done = time.perf_counter()
    except Exception as exc:  # a hung or broken phase must not cost the others
        out["error"] = f"{type(exc).__name__}: {exc}"
        log(f"reset: {out['error']}\n{tail(broker.log_dir / 'broker.stdout')}")
        out.update(rows=rows, wall_s=round(time.perf_counter() - t_phase, 2))
        broker.stop()
        return out
    broker.stop()
    e_first, e_again = max_errors(first["value"]), max_errors(again["value"])
    diff = {k: abs(e_first[k] - e_again.get(k, float("nan"))) for k in e_first}
    fp_a, fp_b = fp_first.get("value") or {}, fp_last.get("value") or {}
    flat_a, flat_b = _flatten(fp_a), _flatten(fp_b)
    differs = sorted(k for k in set(flat_a) | set(flat_b) if flat_a.get(k) != flat_b.get(k))
    out.update(
        wall_s=round(t_done - t_phase, 2),
        rows=rows,
        others_run=ran,
        case=profile.ids[0],
        first_max_abs_err=e_first,
        again_max_abs_err=e_again,
        identical=bool(e_first) and e_first == e_again,
        max_abs_diff=diff,
        first_duration_s=first["duration_s"],
        again_duration_s=again["duration_s"],
        fingerprint_after_first=fp_a,
        fingerprint_after_all=fp_b,
        fingerprint_differs_in=differs,
        fingerprint_stable=not set(differs) - VOLATILE_FINGERPRINT,
        groups_started=out.get("status", {}).get("totals", {}).get("groups_started"),
        pools=pool_summary(out.get("status", {})),
    )
    out["ok"] = (
        first["outcome"] == again["outcome"] == "passed"
        and out["identical"]
        and all(r["outcome"] in ("passed", "skipped") for r in rows)
    )
    return out


# --------------------------------------------------------------------------------------
# Phase: cpq (one pytest session against a fresh broker)
# --------------------------------------------------------------------------------------


def parse_junit(path: Path) -> list[dict[str, Any]]:
    """Per-test rows from pytest's JUnit XML (our own file): id, outcome, time."""
    tests: list[dict[str, Any]] = []
    if not path.exists():
        return tests
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = "skipped"
        tests.append(
            {
                "name": case.get("name", ""),
                "outcome": outcome,
                "time_s": float(case.get("time") or 0.0),
            }
        )
    return tests


def phase_cpq(
    profile: Profile, work: Path, env: dict[str, str], budget: Budget, reserve: float
) -> dict[str, Any]:
    """The whole matrix as one pytest session on a fresh broker."""
    logs = work / "logs"
    broker = private_broker(work, "cpq", profile.broker_gpus, env)
    junit = logs / "cpq_junit.xml"
    pytest_log = logs / "cpq_pytest.log"
    cmd = [sys.executable, "-m", "pytest", *plugin_args(), "-p", "no:cacheprovider", "-q"]
    cmd += [f"--junitxml={junit}", "--durations=0"]
    cmd += profile.pytest_args
    out: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "pytest", *cmd[3:]]),
        "broker_start_s": round(broker.start_s, 3),
    }
    try:
        session_env = dict(broker.env, CPQ_AUTOSTART="0")
        left = budget.left()
        limit = max(min(400.0, max(left - reserve, 0.5 * left)), 1.0)
        log(f"cpq: {out['command']} (limit {limit:.0f} s)")
        rc, wall, _, _ = run_logged(cmd, pytest_log, session_env, profile.pytest_cwd, limit)
        status: dict[str, Any] = {}
        try:
            status = broker.status()
        except Exception as exc:
            out["status_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        broker.stop()
    tests = parse_junit(junit)
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error")}
    counts["skipped"] = sum(t["outcome"] == "skipped" for t in tests)
    times = [t["time_s"] for t in tests]
    totals = status.get("totals", {})
    out.update(
        rc=rc,
        wall_s=round(wall, 3),
        tests=tests,
        counts=counts,
        cases=len(tests),
        sum_test_s=round(sum(times), 3),
        first_test_s=times[0] if times else None,
        median_other_test_s=round(statistics.median(times[1:]), 4) if len(times) > 1 else None,
        outside_tests_s=round(wall - sum(times), 3),
        groups_started=totals.get("groups_started"),
        group_start_s=totals.get("group_start_s"),
        pools=pool_summary(status),
        status=status,
    )
    if rc != 0 or counts["passed"] == 0:
        log(f"cpq: pytest rc {rc}, {counts}; log tail:\n{tail(pytest_log)}")
    return out


# --------------------------------------------------------------------------------------
# Phase: torchrun per case
# --------------------------------------------------------------------------------------


def split_wall(data: dict[str, Any] | None, t0: float, t_end: float) -> dict[str, float | None]:
    """One torchrun's wall split at rank 0's epoch stamps (SEGMENTS); missing stamps fold
    into the next segment, so the parts always add up to ``t_end - t0``."""
    stamps = ((data or {}).get("stamps") or [{}])[0] or {}
    parts: dict[str, float | None] = {name: None for name, _, _ in SEGMENTS}
    if not stamps or t0 <= 0:
        return parts  # no driver JSON (it died early): nothing to split
    prev = t0
    for name, key, _ in SEGMENTS:
        at = t_end if key is None else stamps.get(key)
        if at is None:
            parts[name] = None
            continue
        parts[name] = round(float(at) - prev, 3)
        prev = float(at)
    return parts


def case_compute_estimate(value: Any) -> float | None:
    """Seconds a TE case needs once its kernels exist: reference + CP pass, ``warmup`` and
    ``iters`` timed CP steps, ``iters // 2`` timed reference steps (run_dpa_with_cp)."""
    if not isinstance(value, dict) or "cp_ms" not in value:
        return None
    iters = int(value.get("iters", 10))
    cp_steps, ref_steps = 1 + 2 + iters, 1 + max(iters // 2, 1)
    return (cp_steps * float(value["cp_ms"]) + ref_steps * float(value.get("ref_ms", 0))) / 1e3


def phase_torchrun(
    profile: Profile, work: Path, env: dict[str, str], budget: Budget, k: int, first_guess: float
) -> dict[str, Any]:
    """Up to ``k`` cases, each a whole ``torchrun``, while the budget allows another."""
    logs = work / "logs"
    runs: list[dict[str, Any]] = []
    guess = first_guess
    for index in profile.torchrun_order[:k]:
        if budget.left() < guess * 1.15 + 5:
            log(f"torchrun: budget: stopping after {len(runs)} of {k} cases")
            break
        json_path = work / f"torchrun_{index}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(WORLD_SIZE), str(profile.torchrun_script)]
        if profile.name == "selftest":
            cmd.insert(cmd.index(str(profile.torchrun_script)) + 1, "--driver")
        cmd += ["--cases", str(index), "--json", str(json_path)]
        t0 = time.time()
        run_env = dict(env, TE_STANDALONE_T0=f"{t0:.6f}")
        limit = max(min(240.0, budget.left() - 2), 1.0)
        rc, wall, _, t_end = run_logged(cmd, logs / f"torchrun_{index}.log", run_env, ROOT, limit)
        data: dict[str, Any] | None = None
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(json_path.read_text())
        row = ((data or {}).get("rows") or [{}])[0]
        parts = split_wall(data, t0, t_end)
        compute = case_compute_estimate(row.get("value"))
        case_s = parts.get("case")
        run = {
            "index": index,
            "case": profile.ids[index],
            "rc": rc,
            "wall_s": round(wall, 3),
            "outcome": row.get("outcome", "no result"),
            "case_wall_s": row.get("wall_s"),
            "parts_s": parts,
            "case_compute_est_s": None if compute is None else round(compute, 4),
            "case_warmup_est_s": None
            if compute is None or case_s is None
            else round(case_s - compute, 3),
            "marks": (data or {}).get("marks"),
            "value": row.get("value"),
        }
        if row.get("error"):
            run["error"] = str(row["error"])[:2000]
        runs.append(run)
        log(f"torchrun: {run['case']}: {run['outcome']} rc {rc}, wall {wall:.1f} s")
        if rc != 0:
            log(f"torchrun log tail:\n{tail(logs / f'torchrun_{index}.log')}")
        guess = max(r["wall_s"] for r in runs)
    walls = [r["wall_s"] for r in runs]
    means: dict[str, float | None] = {}
    for name, _, _ in SEGMENTS:
        values = [r["parts_s"][name] for r in runs if r["parts_s"].get(name) is not None]
        means[name] = round(statistics.fmean(values), 3) if values else None
    for key in ("case_compute_est_s", "case_warmup_est_s"):
        values = [r[key] for r in runs if r[key] is not None]
        means[key] = round(statistics.fmean(values), 3) if values else None
    return {
        "runs": runs,
        "cases": len(runs),
        "wall_s": round(sum(walls), 3),
        "mean_wall_s": round(statistics.fmean(walls), 3) if walls else None,
        "median_wall_s": round(statistics.median(walls), 3) if walls else None,
        "min_wall_s": min(walls) if walls else None,
        "max_wall_s": max(walls) if walls else None,
        "mean_parts_s": means,
        "ok": bool(runs) and all(r["rc"] == 0 and r["outcome"] == "passed" for r in runs),
    }


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _f(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def build_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows: mode, cases, wall s, spawns, per-case s, ratio (torchrun mean x cases / wall)."""
    n = int(results.get("matrix_cases") or 24)
    tr, cq, rs = results.get("torchrun"), results.get("cpq"), results.get("reset")
    per_case = tr.get("mean_wall_s") if tr else None
    rows: list[dict[str, Any]] = []

    def add(mode: str, cases: int, wall: float | None, spawns: Any) -> None:
        ratio = None
        if per_case and wall:
            ratio = round(per_case * cases / wall, 2)
        per = None if wall is None or not cases else round(wall / cases, 3)
        rows.append(
            {
                "mode": mode,
                "cases": cases,
                "wall_s": wall,
                "spawns": spawns,
                "per_case_s": per,
                "ratio": ratio,
            }
        )

    if tr and tr.get("cases") and per_case:
        add("torchrun per case (measured)", tr["cases"], tr["wall_s"], tr["cases"])
        add(f"torchrun per case (x{n}, from mean)", n, round(per_case * n, 1), n)
    if cq and cq.get("wall_s") is not None:
        add("cpq, one pytest session", cq["cases"], cq["wall_s"], cq.get("groups_started"))
    if rs and rs.get("rows"):
        cases = sum(1 for r in rs["rows"] if not r["label"].startswith("fingerprint"))
        add(
            "cpq Client, reset check (fresh group)",
            cases,
            rs.get("wall_s"),
            rs.get("groups_started"),
        )
    return rows


def render(results: dict[str, Any]) -> str:
    lines: list[str] = []
    machine = results.get("machine", {})
    lines.append(
        f"=== {results.get('title', 'bench_te')} — {machine.get('host', '?')}, "
        f"{machine.get('gpus') or 'no GPU'} ==="
    )
    header = f"{'mode':36} {'cases':>5} {'wall s':>8} {'spawns':>6} {'per-case s':>10} {'ratio':>6}"
    lines += [header, "-" * len(header)]
    for row in results.get("table", []):
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.1f}x"
        lines.append(
            f"{row['mode']:36} {row['cases']:>5} {_f(row['wall_s'], 1):>8} "
            f"{row['spawns'] if row['spawns'] is not None else '-':>6} "
            f"{_f(row['per_case_s'], 2):>10} {ratio:>6}"
        )
    tr = results.get("torchrun")
    if tr and tr.get("runs"):
        means = tr["mean_parts_s"]
        lines.append(
            f"\ntorchrun per case: where the wall goes (rank 0, mean of {tr['cases']}; "
            f"walls {_f(tr['min_wall_s'], 1)}-{_f(tr['max_wall_s'], 1)} s)"
        )
        label = {name: text for name, _, text in SEGMENTS}
        label["import_te"] = results.get("import_label", label["import_te"])
        for name, _, _ in SEGMENTS:
            extra = ""
            if name == "case" and means.get("case_warmup_est_s") is not None:
                extra = (
                    f"   (~{_f(means['case_warmup_est_s'])} warm-up: kernels / cuDNN plans; "
                    f"~{_f(means['case_compute_est_s'])} steady compute)"
                )
            lines.append(f"  {label[name]:52} {_f(means.get(name)):>7}{extra}")
        lines.append(f"  {'= wall':52} {_f(tr['mean_wall_s']):>7}")
        short = ["launch", "torch", "cuda", "te", "pg", "prep", "case", "tear"]
        lines.append(f"  {'per run, s':40}" + "".join(f"{c:>7}" for c in [*short, "wall"]))
        for r in tr["runs"]:
            cells = [_f(r["parts_s"].get(name)) for name, _, _ in SEGMENTS] + [_f(r["wall_s"])]
            note = (
                ""
                if r["rc"] == 0 and r["outcome"] == "passed"
                else f"  {r['outcome']} rc {r['rc']}"
            )
            lines.append(f"  {r['case'][:40]:40}" + "".join(f"{c:>7}" for c in cells) + note)
    cq = results.get("cpq")
    if cq and cq.get("wall_s") is not None:
        ready = ", ".join(_f(p.get("ready_after_s")) for p in cq.get("pools", [])) or "-"
        lines += [
            f"\ncpq: pytest rc {cq['rc']}, {cq['counts']}",
            f"  broker start (not in wall)                      {_f(cq['broker_start_s'])}",
            f"  group ready after (launch, torch, preload, pg)  {ready}",
            f"  first test (waits for the group, then warm-up)  {_f(cq['first_test_s'])}",
            f"  median of the other tests                       {_f(cq['median_other_test_s'], 3)}",
            f"  outside tests (pytest start, collection, exit)  {_f(cq['outside_tests_s'])}",
        ]
        slow = sorted(cq.get("tests", []), key=lambda t: -t["time_s"])[:6]
        lines.append(
            "  slowest tests: " + ", ".join(f"{t['name']} {t['time_s']:.2f}" for t in slow)
        )
    rs = results.get("reset")
    if rs and rs.get("rows"):
        if "identical" in rs:
            lines.append(
                f"\nreset check ({rs['case']}): first on a fresh group "
                f"{_f(rs['first_duration_s'])} s, again after {rs['others_run']} others "
                f"{_f(rs['again_duration_s'], 3)} s; max errors first {rs['first_max_abs_err']}, "
                f"again {rs['again_max_abs_err']}: identical {rs['identical']}; "
                f"fingerprint stable {rs['fingerprint_stable']} "
                f"(differs in {rs['fingerprint_differs_in'] or 'nothing'})"
            )
        if rs.get("error"):
            lines.append(f"\nreset check broke off: {rs['error']}")
    lines.append(f"\nverdict: {results.get('verdict')}")
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    for dist in ("torch", "transformer_engine", "transformer_engine_torch", "pyzmq"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[dist] = importlib.metadata.version(dist)
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            names = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.split("\n")
            gpus = [n.strip() for n in names if n.strip()]
            info["gpus"] = f"{len(gpus)}x {gpus[0]}" if gpus else ""
    return info


def verdict(results: dict[str, Any]) -> str:
    notes: list[str] = []
    cq, tr, rs = results.get("cpq"), results.get("torchrun"), results.get("reset")
    if cq is not None:
        bad = cq.get("rc") != 0 or not cq.get("counts", {}).get("passed")
        notes.append(f"cpq {'FAILED' if bad else 'ok'} ({cq.get('counts')})")
    if tr is not None:
        notes.append(f"torchrun {'ok' if tr.get('ok') else 'FAILED'} ({tr.get('cases')} runs)")
    if rs is not None:
        notes.append(f"reset {'ok' if rs.get('ok') else 'FAILED'}")
    return "; ".join(notes) or "nothing ran"


def write_json(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    tmp.replace(path)


def pack_logs(work: Path, dest: Path, max_bytes: int = 12 * 2**20) -> None:
    """The run's logs (brokers, groups, ranks, torchrun, pytest) in one tar.gz, bounded."""
    files = sorted(p for p in (work / "logs").rglob("*") if p.is_file())
    files += sorted(work.glob("torchrun_*.json"))
    with tarfile.open(dest, "w:gz") as tar:
        for path in files:
            tar.add(path, arcname=str(path.relative_to(work)))
    if dest.stat().st_size > max_bytes:
        with tarfile.open(dest, "w:gz") as tar:  # too big to come back: keep the small ones
            for path in files:
                if path.stat().st_size < max_bytes // max(len(files), 1):
                    tar.add(path, arcname=str(path.relative_to(work)))


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------

PHASES = ("reset", "cpq", "torchrun")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--selftest", action="store_true", help="CPU/gloo stand-in, no TE")
    parser.add_argument("--k", type=int, default=6, help="torchrun-per-case runs (default 6)")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="wall budget (default 480; selftest 300)"
    )
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma list, run in order (default {PHASES})"
    )
    parser.add_argument("--reset-others", type=int, default=20, help="cases between the two")
    parser.add_argument("--json", type=Path, default=None, help=f"results (default {DEFAULT_JSON})")
    parser.add_argument("--work", type=Path, default=None, help="logs and scratch (default tmp)")
    parser.add_argument("--logs-tar", type=Path, default=None, help="pack the logs here at the end")
    parser.add_argument("--report", type=Path, default=None, help="print the table of a JSON")
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phase(s) {sorted(unknown)}; choose from {PHASES}")
    args.phase_list = phases
    if args.k < 0 or args.reset_others < 0:
        parser.error("--k and --reset-others must be >= 0")
    if args.budget_s is None:
        args.budget_s = 300.0 if args.selftest else 480.0
    if args.json is None:
        args.json = None if args.selftest else DEFAULT_JSON
    return args


# Seconds each later phase is expected to need; earlier phases leave them this much budget.
ESTIMATES = {
    "te": {"reset": 120.0, "cpq": 150.0, "torchrun": 3 * 40.0, "torchrun_one": 45.0},
    "selftest": {"reset": 30.0, "cpq": 40.0, "torchrun": 2 * 15.0, "torchrun_one": 15.0},
}


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--driver"]:
        return driver_main(argv[1:])
    args = parse_args(argv)
    if args.report:
        print(render(json.loads(args.report.read_text())))
        return 0
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_te-"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    json_path: Path = args.json or work / "bench_te_selftest.json"
    profile = selftest_profile(work) if args.selftest else te_profile()
    estimates = ESTIMATES[profile.name]
    budget = Budget(args.budget_s)
    env = child_env(repo_first=False)
    results: dict[str, Any] = {
        "title": "TE CP attention, ws=2: torchrun per case vs cpq"
        if profile.name == "te"
        else "selftest (CPU, gloo, workers.cp_attention): torchrun per case vs cpq",
        "date": _dt.date.today().isoformat(),
        "command": shlex.join(["python", "tools/bench_te.py", *argv]),
        "profile": profile.name,
        "machine": machine_info(),
        "budget_s": args.budget_s,
        "phases": args.phase_list,
        "matrix_cases": len(profile.cases),
        "import_label": profile.import_label,
        "env": {
            k: os.environ.get(k)
            for k in (
                "NCCL_NVLS_ENABLE",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                "NVSHMEM_DISABLE_NVLS",
                "PYTHONPATH",
                "CUDA_VISIBLE_DEVICES",
            )
        },
        "work": str(work),
    }
    log(f"profile {profile.name}, phases {args.phase_list}, budget {args.budget_s:.0f} s, "
        f"work {work}")  # fmt: skip
    for position, phase in enumerate(args.phase_list):
        later = args.phase_list[position + 1 :]
        reserve = sum(estimates[p] for p in later)
        log(f"phase {phase} (left {budget.left():.0f} s, reserved for {later}: {reserve:.0f} s)")
        started = time.perf_counter()
        try:
            if phase == "reset":
                results["reset"] = phase_reset(
                    profile, work, env, budget, args.reset_others, reserve
                )
            elif phase == "cpq":
                results["cpq"] = phase_cpq(profile, work, env, budget, reserve)
            else:
                results["torchrun"] = phase_torchrun(
                    profile, work, env, budget, args.k, estimates["torchrun_one"]
                )
        except Exception as exc:  # record it, go on with the next phase
            results[phase] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"phase {phase} failed: {results[phase]['error']}")
        results.setdefault("phase_wall_s", {})[phase] = round(time.perf_counter() - started, 2)
        results["table"] = build_table(results)
        results["verdict"] = verdict(results)
        results["elapsed_s"] = round(budget.elapsed(), 2)
        write_json(json_path, results)
    print("\n" + render(results), flush=True)
    log(f"results: {json_path}")
    if args.logs_tar:
        with contextlib.suppress(OSError, tarfile.TarError):
            pack_logs(work, args.logs_tar)
            log(f"logs: {args.logs_tar}")
    return 0 if "FAILED" not in results["verdict"] else 1


if __name__ == "__main__":
    sys.exit(main())
