"""Warm torchrun launches against real ones, side by side in one run (issue 28).

N launches of a small script (import torch, init the default group, one all_reduce,
destroy) by the real ``torchrun`` and by ``cpq torchrun`` on a private broker, alternated.
Each launch's wall time is taken around the launching process (what a test that calls
``subprocess.run`` waits); the script prints its own time (from its first line to its
last, on each rank), so what a launch costs beyond the script's own work is
``wall - the slowest rank's script time``.

    python tools/bench_torchrun.py [--launches 10] [--nproc 2] [--gpus none|auto]
        [--script PATH]   # another script (it must print SCRIPT_S <seconds>)
        [--suite N]       # also: a pytest suite of N tests that each launch the script,
                          # plain against --cpq-torchrun (cold, then warm), one run each
        [--accelerate]    # only: accelerate 1.15's own distributed test scripts launched
                          # per test as accelerate's tests do (and one failing on rank 1),
                          # plain against --cpq-torchrun cold and twice warm (issue 37)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import PrivateBroker, child_env, plugin_args

SCRIPT = """
import time
started = time.perf_counter()
import torch
import torch.distributed as dist

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
t = torch.ones(1, device=device)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
print(f"SCRIPT_S {time.perf_counter() - started:.4f}")
"""


def launch(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall, the slowest rank's own script time) of one launch."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{command} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    own = [float(m) for m in re.findall(r"SCRIPT_S ([0-9.]+)", done.stdout)]
    return wall, max(own) if own else 0.0


SUITE = """
import subprocess
import sys

import pytest


@pytest.mark.parametrize("case", range({n}))
def test_launch(case):
    done = subprocess.run(
        ["torchrun", "--nproc-per-node", "{nproc}", "{script}", str(case)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("SCRIPT_S") == {nproc}
"""


ROUTED = """
import json
import os
import re
import subprocess
import sys
import time


def _launch(command):
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    own = [float(m) for m in re.findall(r"SCRIPT_S ([0-9.]+)", done.stdout)]
    return wall, max(own or [0.0])


def test_routed_launches():
    args = ["--nproc-per-node", "{nproc}", "{script}"]
    runs = {{"relay": [], "process": [], "interpreter": []}}
    _launch(["torchrun", *args])
    for _ in range({n}):
        runs["relay"].append(_launch(["torchrun", *args]))
        runs["process"].append(_launch([sys.executable, "-m", "cpq", "torchrun", *args]))
        runs["interpreter"].append(_launch([sys.executable, "-sS", "-c", "pass"]))
    with open(os.environ["BENCH_ROUTED_OUT"], "w") as out:
        json.dump(runs, out)
"""


def routed_runs(
    n: int, nproc: int, script: Path, work: Path, env: dict[str, str]
) -> dict[str, list[tuple[float, float]]]:
    """``n`` launches from inside a ``pytest --cpq-torchrun`` test, alternated: ``torchrun``
    as the test names it (the shim, served by the session's launch relay) and ``python -m cpq
    torchrun`` (a client of its own per launch, what the shim ran before the relay)."""
    project = work / "routed"
    project.mkdir()
    (project / "test_routed.py").write_text(ROUTED.format(n=n, nproc=nproc, script=script))
    out = work / "routed.json"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin_args()]
    command.append("--cpq-torchrun")
    done = subprocess.run(
        command,
        cwd=project,
        env=dict(env, BENCH_ROUTED_OUT=str(out)),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"the routed launches failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    runs = json.loads(out.read_text())
    return {
        "torchrun in a --cpq-torchrun test (the session's launch relay)": runs["relay"],
        "python -m cpq torchrun in that test (a client per launch)": runs["process"],
        "(the shim's floor: python -sS -c pass, started from that test)": runs["interpreter"],
    }


def broker_parts(state: Path) -> str:
    """The broker's own view of the warm launches (its timing history): the median wait in
    its queue and dispatch-to-verdict (the ranks' part: the boundary, the script, the report)."""
    rows = []
    for line in (state / "timings.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("target") == "cpq.rank.script:run_script" and record.get("attempts") == 1:
            rows.append((record["queue_s"], record["duration_s"]))
    rows = rows[1:]  # the first waited for its group to start
    if not rows:
        return "(no launches in the broker's timing history)"
    queue = statistics.median(q for q, _ in rows) * 1e3
    duration = statistics.median(d for _, d in rows) * 1e3
    return (
        f"the broker's view of {len(rows)} warm launches (median): queued {queue:.1f} ms, "
        f"dispatch to verdict {duration:.1f} ms"
    )


def suite_walls(n: int, nproc: int, script: Path, work: Path, env: dict[str, str]) -> list[str]:
    """A suite of ``n`` launching tests: plain, then under --cpq-torchrun cold and warm."""
    project = work / "suite"
    project.mkdir()
    (project / "test_launches.py").write_text(SUITE.format(n=n, nproc=nproc, script=script))
    rows = []
    for name, extra in (
        ("plain", []),
        ("--cpq-torchrun, cold", ["--cpq-torchrun"]),
        ("--cpq-torchrun, warm", ["--cpq-torchrun"]),
    ):
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += [*plugin_args(), *extra] if extra else []
        start = time.perf_counter()
        done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}")
        rows.append(f"| {name} | {wall:.1f} |")
    return rows


ACCELERATE_SUITE = """
import os

import pytest
from accelerate.test_utils import execute_subprocess_async, path_in_accelerate_package

SCRIPTS = ["test_script", "test_sync", "test_ops", "test_cli", "test_ddp_comm_hook",
           "test_merge_weights"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_accelerate_script(name):
    script = path_in_accelerate_package("test_utils", "scripts", f"{name}.py")
    execute_subprocess_async(["torchrun", "--nproc-per-node", "2", str(script)],
                             env=os.environ.copy())


def test_fails_on_rank_one():
    execute_subprocess_async(["torchrun", "--nproc-per-node", "2", "fail_rank1.py"],
                             env=os.environ.copy())
"""

FAIL_RANK1 = """
from accelerate import PartialState

state = PartialState(cpu=True)
if state.process_index == 1:
    raise RuntimeError("rank one fails on purpose")
state.wait_for_everyone()
"""


def accelerate_walls(work: Path, env: dict[str, str]) -> list[str]:
    """accelerate's scripts per test: plain, then --cpq-torchrun cold and twice warm; the
    verdicts must agree (each session's line of outcomes is printed)."""
    project = work / "accelerate"
    (project / "bin").mkdir(parents=True)
    (project / "test_accelerate_scripts.py").write_text(ACCELERATE_SUITE)
    (project / "fail_rank1.py").write_text(FAIL_RANK1)
    torchrun = project / "bin" / "torchrun"  # this interpreter's, whatever PATH holds
    torchrun.write_text(f'#!/bin/sh\nexec {sys.executable} -m torch.distributed.run "$@"\n')
    torchrun.chmod(0o755)
    env = dict(env, ACCELERATE_USE_CPU="true", PATH=f"{project / 'bin'}:{env['PATH']}")
    rows, plain = [], 0.0
    for name, extra in (
        ("plain", []),
        ("--cpq-torchrun, cold", ["--cpq-torchrun"]),
        ("--cpq-torchrun, warm 1", ["--cpq-torchrun"]),
        ("--cpq-torchrun, warm 2", ["--cpq-torchrun"]),
    ):
        command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *extra]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        plain = plain or wall
        verdicts = done.stdout.strip().splitlines()[-1]
        rows.append(f"| {name} | {wall:.1f} | {wall / plain:.2f} | {verdicts} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--gpus", default="none")
    parser.add_argument("--script", type=Path, default=None)
    parser.add_argument("--suite", type=int, default=0)
    parser.add_argument("--accelerate", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-torchrun-"))
    if args.accelerate:
        broker = PrivateBroker(work / "state", work / "logs", "none", child_env())
        try:
            rows = accelerate_walls(work, dict(broker.env, CPQ_AUTOSTART="0"))
        finally:
            broker.stop()
        print("accelerate 1.15's scripts, one test each (ws=2, CPU, gloo):")
        print("| session | wall (s) | of plain | verdicts |")
        print("| --- | --- | --- | --- |")
        print("\n".join(rows))
        return
    script = args.script.resolve() if args.script else work / "script.py"
    if args.script is None:
        script.write_text(SCRIPT)
    env = child_env()
    broker = PrivateBroker(work / "state", work / "logs", args.gpus, env)
    cpq_env = dict(broker.env, CPQ_AUTOSTART="0")
    real = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}"]
    warm = [sys.executable, "-m", "cpq", "torchrun", f"--nproc-per-node={args.nproc}"]
    results: dict[str, list[tuple[float, float]]] = {"torchrun": [], "cpq torchrun": []}
    try:
        launch([*warm, str(script)], script.parent, cpq_env)  # the group starts once
        for _ in range(args.launches):
            results["torchrun"].append(launch([*real, str(script)], script.parent, env))
            results["cpq torchrun"].append(launch([*warm, str(script)], script.parent, cpq_env))
        results.update(routed_runs(args.launches, args.nproc, script, work, cpq_env))
        suite = suite_walls(args.suite, args.nproc, script, work, cpq_env) if args.suite else []
    finally:
        broker.stop()
    print(
        f"{args.launches} launches each, --nproc-per-node {args.nproc}, gpus={args.gpus}, "
        f"script {script.name}"
    )
    print(
        "| launcher | wall per launch, median (s) | script's own time (s) | beyond the script (s) |"
    )
    print("| --- | --- | --- | --- |")
    for name, runs in results.items():
        wall = statistics.median(w for w, _ in runs)
        own = statistics.median(o for _, o in runs)
        beyond = statistics.median(w - o for w, o in runs)
        print(f"| {name} | {wall:.3f} | {own:.3f} | {beyond:.3f} |")
    print(broker_parts(broker.state))
    print(f"(broker start {broker.start_s:.1f} s, not counted; logs in {work})")
    if suite:
        print(f"\nA suite of {args.suite} tests, each launching the script with torchrun:")
        print("| session | wall (s) |")
        print("| --- | --- |")
        print("\n".join(suite))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
