"""A warm ``--cpq-world-size`` session with the ranks opening it ahead, against a tree
without that (cpq.client.opening), side by side in one run, alternated.

The project stands in for a suite that imports the world (Megatron-LM's conftest imports
torch and ``megatron.core``, its test modules more of it): its conftest imports torch, and a
package of its own whose import costs ``--import-s`` seconds of CPU (work at import, as a
large package's module bodies do) is imported by the test module (``--where module``: during
collection, which the opening overlaps) or by the conftest (``--where conftest``: before the
session starts, which it cannot). The calling process pays that to collect; each rank pays
it again when it builds the session, since a new session imports the project afresh
(docs/design.md, "The session boundary"). Each tree gets a private broker, warmed by one
session first; then ``--reps`` warm sessions per tree, alternated. Printed: each session's
wall (s), and the median.

    python tools/bench_opening.py [--baseline 9ef1163] [--tests 100] [--reps 3]
        [--import-s 1.0] [--world-size 1] [--where module|conftest] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_pytest_ranks import (
    ROOT,
    add_worktree,
    print_trees,
    remove_worktree,
    settle,
    start_broker,
    tree_env,
)

SLOW_PACKAGE = """
import time

# Work at import, standing in for a large package's module bodies.
_end = time.process_time() + {seconds}
_table = {{}}
while time.process_time() < _end:
    for i in range(10000):
        _table[i] = hash((i, len(_table)))
"""

CONFTEST = """
import torch
{slow}"""

TESTS = """
import pytest
import torch
{slow}

@pytest.mark.parametrize("i", range({n}))
def test_small(i):
    assert float(torch.ones(2).sum()) == 2.0
"""


def session_wall(project: Path, env: dict[str, str], world_size: int) -> float:
    settle(env)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "cpq.client.plugin"]
    command += ["-p", "no:cacheprovider", "--cpq-world-size", str(world_size), "tests"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"session failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default="9ef1163", help="a commit without the opening")
    parser.add_argument("--tests", type=int, default=100)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--import-s", type=float, default=1.0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument(
        "--where",
        choices=("conftest", "module"),
        default="module",
        help="who imports the package: the conftest (before the session starts) or the "
        "test module (during collection)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-opening-"))
    project = work / "project"
    (project / "tests").mkdir(parents=True)
    (project / "slowpkg").mkdir()
    (project / "slowpkg" / "__init__.py").write_text(SLOW_PACKAGE.format(seconds=args.import_s))
    slow = "import slowpkg  # noqa: F401\n"
    conftest_slow, module_slow = (slow, "") if args.where == "conftest" else ("", slow)
    (project / "tests" / "conftest.py").write_text(CONFTEST.format(slow=conftest_slow))
    (project / "tests" / "test_many.py").write_text(TESTS.format(n=args.tests, slow=module_slow))
    base = work / "baseline"
    add_worktree(base, args.baseline)
    trees = {"this checkout": ROOT, f"before ({args.baseline})": base}
    envs = {}
    for i, (name, tree) in enumerate(trees.items()):
        env = tree_env(tree, work / f"state-{i}")
        env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{project}"  # slowpkg, as installed
        envs[name] = env
    brokers = [
        start_broker(env, "none", work / f"broker-{i}.log") for i, env in enumerate(envs.values())
    ]
    walls: dict[str, list[float]] = {name: [] for name in trees}
    try:
        for env in envs.values():  # warm: groups up, torch imported in the ranks
            session_wall(project, env, args.world_size)
        for _ in range(args.reps):
            for name, env in envs.items():
                walls[name].append(session_wall(project, env, args.world_size))
    finally:
        for proc in brokers:
            proc.terminate()
        for proc in brokers:
            proc.wait(timeout=60)
        remove_worktree(base)
    print(
        f"{args.tests} tests, --cpq-world-size {args.world_size}, the project's import "
        f"{args.import_s} s of CPU in the {args.where}, {args.reps} warm sessions per tree, "
        "alternated"
    )
    print_trees("warm session wall, median (s)", "sessions (s)", walls)
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "walls": walls})
        )


if __name__ == "__main__":
    main()
