"""Cold ``--cpq-world-size`` sessions (a broker started with no group just before each, as after
the background broker idled out), this checkout against an earlier tree, with the fresh
``torchrun -m pytest`` run beside them; alternated, in one run.

This checkout asks for the group the project's last session needed (pytest's cache) before
the conftests import (cpq/client/early_warm.py); the earlier tree asked at session start,
after them. The project's conftest imports torch and a package of its own whose import costs
``--import-s`` seconds of CPU, standing in for a suite whose conftest imports the world
(Megatron-LM's). Each tree has its own copy of the project (its own cache: a spec's roots
name the tree), primed by one session whose cache the measured ones then read. Printed: each
session's wall and cpq's "waiting for groups to start" figure, medians per tree.

    python tools/bench_cold.py [--baseline 1c760c6] [--reps 3] [--import-s 2.0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_opening import CONFTEST, SLOW_PACKAGE, TESTS
from bench_pytest_ranks import (
    ROOT,
    add_worktree,
    quiet_cpu,
    remove_worktree,
    start_broker,
    tree_env,
)

WAIT = re.compile(r"([0-9.]+)s waiting for groups to start")


def cold_session(project: Path, env: dict[str, str], log: Path) -> tuple[float, float]:
    """(wall, spawn wait) of one session on a broker started for it, stopped after it."""
    shutil.rmtree(env["CPQ_STATE_DIR"], ignore_errors=True)
    broker = start_broker(env, "none", log)
    quiet_cpu()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "cpq.client.plugin"]
    command += ["--cpq-world-size", "1", "tests"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    broker.terminate()
    broker.wait(timeout=60)
    if done.returncode != 0:
        raise SystemExit(f"session failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    waited = WAIT.search(done.stdout)
    return wall, float(waited.group(1)) if waited else float("nan")


def fresh_session(project: Path, env: dict[str, str], *extra: str) -> float:
    """The fresh run's wall: ``torchrun -m pytest`` (``extra``: more pytest arguments)."""
    quiet_cpu()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "1", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += [*extra, "tests"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"fresh run failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default="1c760c6", help="a commit without early_warm")
    parser.add_argument("--tests", type=int, default=50)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--import-s", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-cold-"))
    base = work / "baseline"
    add_worktree(base, args.baseline)
    trees = {"this checkout": ROOT, f"before ({args.baseline})": base}
    projects, envs = {}, {}
    for i, (name, tree) in enumerate(trees.items()):
        project = work / f"project-{i}"
        (project / "tests").mkdir(parents=True)
        (project / "slowpkg").mkdir()
        (project / "slowpkg" / "__init__.py").write_text(SLOW_PACKAGE.format(seconds=args.import_s))
        conftest = CONFTEST.format(slow="import slowpkg  # noqa: F401\n")
        (project / "tests" / "conftest.py").write_text(conftest)
        (project / "tests" / "test_many.py").write_text(TESTS.format(n=args.tests, slow=""))
        (project / "pytest.ini").write_text("[pytest]\n")
        env = tree_env(tree, work / f"state-{i}")
        env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{project}"
        projects[name], envs[name] = project, env
    walls: dict[str, list[float]] = {name: [] for name in trees}
    waits: dict[str, list[float]] = {name: [] for name in trees}
    fresh: list[float] = []
    try:
        for name in trees:  # prime each project's cache (its first session ever)
            cold_session(projects[name], envs[name], work / "broker.log")
        for _ in range(args.reps):
            for name in trees:
                wall, waited = cold_session(projects[name], envs[name], work / "broker.log")
                walls[name].append(wall)
                waits[name].append(waited)
            fresh.append(fresh_session(projects["this checkout"], envs["this checkout"]))
    finally:
        remove_worktree(base)
    print(
        f"{args.tests} tests, --cpq-world-size 1, the conftest's import {args.import_s} s of "
        f"CPU, {args.reps} cold sessions per tree (a new broker each), alternated"
    )
    print("| run | wall, median (s) | walls (s) | waiting for groups (s) |")
    print("| --- | --- | --- | --- |")
    fresh_walls = ", ".join(f"{v:.2f}" for v in fresh)
    print(f"| fresh torchrun -m pytest | {statistics.median(fresh):.2f} | {fresh_walls} | - |")
    for name in trees:
        listed = ", ".join(f"{v:.2f}" for v in walls[name])
        waited = ", ".join(f"{v:.1f}" for v in waits[name])
        print(f"| {name} | {statistics.median(walls[name]):.2f} | {listed} | {waited} |")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "walls": walls,
                    "waits": waits,
                    "fresh": fresh,
                }
            )
        )


if __name__ == "__main__":
    main()
