"""What pytest + cpq add per test on a warm group, this checkout against an earlier one.

Issue 27 moved the test's whole protocol into the ranks (each rank runs pytest): this
measures its price side by side with the tree before it, in one run, alternated. A project
of N no-op ``@pytest.mark.cpq(world_size=2)`` tests (and one of a single test) runs on a
private broker per tree, already warm (one session first); the cost per test is

    (wall of the N-test session - wall of the 1-test session) / (N - 1)

so start-up, collection of torch and the broker's spawn cancel out and what is left is
everything a test costs beyond its own (empty) body: the pytest process's protocol, the
submit, the broker, the ranks (reset, and now their pytest protocol), the reports back.

    python tools/bench_pytest_ranks.py [--tests 200] [--reps 3] [--baseline 51d7909]
        [--gpus none|auto] [--world-size 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROJECT = """
import pytest

@pytest.mark.cpq(world_size={ws})
@pytest.mark.parametrize("i", range({n}))
def test_noop(i):
    pass
"""


def tree_env(tree: Path, state: Path) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("CPQ_ENDPOINT", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER"):
        env.pop(key, None)
    given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *given])  # the tree's cpq first
    env["CPQ_STATE_DIR"] = str(state)
    env["CPQ_ENDPOINT"] = f"ipc://{state / 'broker.sock'}"
    env["CPQ_AUTOSTART"] = "0"
    # Only cpq's plugin, from the tree under test (it may be on PYTHONPATH only, as on the
    # GPU host): installed plugins are not billed to either tree.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


def add_worktree(path: Path, commit: str) -> None:
    """An earlier tree of this repository at ``path`` (the baseline a benchmark compares with)."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit],
        check=True,
        capture_output=True,
    )


def remove_worktree(path: Path) -> None:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True
    )


def start_broker(env: dict[str, str], gpus: str, log: Path) -> subprocess.Popen[bytes]:
    state = Path(env["CPQ_STATE_DIR"])
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = open(log, "ab")  # noqa: SIM115 - the broker's for its life
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpq.broker", "--gpus", gpus, "--endpoint", env["CPQ_ENDPOINT"]],
        env=env,
        cwd=state,  # not the repo: `-m` puts the working directory first on sys.path
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not (state / "broker.sock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the broker did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return proc


def settle(env: dict[str, str]) -> None:
    """Wait until the broker starts no group (a spare spawning in the background would take
    the two cores from the session being measured)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done = subprocess.run(
            [sys.executable, "-m", "cpq", "status", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=env["CPQ_STATE_DIR"],
        )
        pools = json.loads(done.stdout).get("pools", []) if done.returncode == 0 else []
        if done.returncode == 0 and not any(p.get("state") == "starting" for p in pools):
            break
        time.sleep(0.5)
    quiet_cpu()


def quiet_cpu(percent: float = 25.0, timeout_s: float = 30.0) -> None:
    """Wait (up to ``timeout_s``) for the machine's CPUs to be quiet: an idle rank of another
    tree's broker may still be importing ahead of its next session (cpq/rank/ahead.py), work
    its broker does not see, which would slow the session measured next."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and psutil.cpu_percent(interval=0.3) > percent:
        pass


def session_wall(project: Path, module: str, env: dict[str, str]) -> float:
    settle(env)
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "cpq.client.plugin",
            "-p",
            "no:cacheprovider",
            module,
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"session failed in {project}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
        )
    return wall


def print_trees(median: str, runs: str, values: dict[str, list[float]]) -> None:
    """A markdown table of each tree's median and its runs (BENCHMARKS.md's form)."""
    print(f"| tree | {median} | {runs} |")
    print("| --- | --- | --- |")
    for name, each in values.items():
        listed = ", ".join(f"{v:.2f}" for v in each)
        print(f"| {name} | {statistics.median(each):.2f} | {listed} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tests", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline", default="51d7909", help="the commit to compare with")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="that commit's files, already extracted (a host without the git history)",
    )
    parser.add_argument("--gpus", default="none")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-pytest-ranks-"))
    project = work / "project"
    project.mkdir()
    (project / "test_many.py").write_text(PROJECT.format(n=args.tests, ws=args.world_size))
    (project / "test_one.py").write_text(PROJECT.format(n=1, ws=args.world_size))
    trees = {"this checkout": ROOT}
    if args.baseline_tree:
        trees[f"before ({args.baseline})"] = args.baseline_tree.resolve()
    elif args.baseline:
        base = work / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
            check=True,
            capture_output=True,
        )
        trees[f"before ({args.baseline})"] = base
    envs = {
        name: tree_env(tree, work / f"state-{i}") for i, (name, tree) in enumerate(trees.items())
    }
    brokers = {
        name: start_broker(env, args.gpus, work / f"broker-{i}.log")
        for i, (name, env) in enumerate(envs.items())
    }
    per_test: dict[str, list[float]] = {name: [] for name in trees}
    try:
        for env in envs.values():  # warm: groups up, modules imported in the ranks
            session_wall(project, "test_many.py", env)
            session_wall(project, "test_one.py", env)
        for _ in range(args.reps):
            for name, env in envs.items():
                many = session_wall(project, "test_many.py", env)
                one = session_wall(project, "test_one.py", env)
                per_test[name].append((many - one) / (args.tests - 1) * 1000)
    finally:
        for proc in brokers.values():
            proc.terminate()
        for proc in brokers.values():
            proc.wait(timeout=60)
        if args.baseline and not args.baseline_tree:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "baseline")],
                capture_output=True,
            )
    print(
        f"{args.tests} no-op ws={args.world_size} tests per session, {args.reps} reps, "
        f"gpus={args.gpus}"
    )
    print_trees("per test, median (ms)", "runs (ms)", per_test)
    if args.json:
        args.json.write_text(json.dumps({"tests": args.tests, "per_test_ms": per_test}, indent=1))


if __name__ == "__main__":
    main()
