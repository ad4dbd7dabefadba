"""A suite of mixed specs on the default budget, side by side in one run (issue 29).

A generated project of ``--cases`` tests per spec written for ``torchrun -m pytest`` (a
session fixture that calls ``init_process_group``; each test one ``all_reduce``, on the GPU
when there is one), whose specs alternate in collection order. ``--mix 1,2,4`` (the
default): world sizes 1, 2 and 4 (CPU, gloo); ``--mix 1:a,1:b``: two ws=1 specs that differ
in a pinned variable (one GPU can hold only one of them). Modes, each on its own state
directory and the broker the plugin autostarts with its default options (what a new user
gets):

* ``torchrun``: the fresh reference, one ``torchrun --nproc-per-node N -m pytest -k <spec>``
  per spec, the walls summed;
* ``cpq``: this code, two sessions (cold: the broker and its groups start; warm: a second
  ``pytest`` on the same broker);
* ``cpq-keep-order``: the same with ``--cpq-keep-order`` (tests alternate world sizes: the
  budget alone, without grouping by spec);
* ``before`` (with ``--before DIR``, a checkout of the cpq package before issue 29): two
  sessions of that code.

For each session: wall time (around the ``pytest`` process), tests passed, groups the
broker started during it (``cpq-status --json`` totals, taken before and after) and groups
evicted (broker log lines). ``--json`` writes every figure.

    python tools/bench_placement.py [--cases 12] [--before .bench-before] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import child_env

CONFTEST = """
import os

import pytest
import torch.distributed as dist


import torch


@pytest.fixture(scope="session", autouse=True)
def process_group():
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    yield
"""

TESTS = """
import pytest
import torch
import torch.distributed as dist

CASES = [
    pytest.param(
        ws, i, id=f"ws{{ws}}{{tag}}-{{i}}",
        marks=pytest.mark.cpq(world_size=ws, env={{"CPQ_BENCH_SPEC": tag}}),
    )
    for i in range({cases})
    for ws, tag in {mix!r}
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("ws", "i"), CASES)
def test_all_reduce(ws, i):
    assert dist.get_world_size() == ws
    t = torch.full((64,), float(dist.get_rank() + i), device=DEVICE)
    dist.all_reduce(t)
    assert t[0].item() == sum(range(ws)) + ws * i
"""


#: Where plugins are not loaded from entry points (the GPU host runs cpq from PYTHONPATH).
PLUGIN = ["-p", "cpq.client.plugin"] if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") else []


def passed(output: str) -> int:
    match = re.search(r"(\d+) passed", output)
    return int(match[1]) if match else 0


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> tuple[float, str]:
    """Run ``cmd``; a failing session is reported (its ``passed`` count shows it), and the
    benchmark goes on to the next mode."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-5:])
        print(f"{' '.join(cmd[-3:])} exited {proc.returncode}:\n{tail}", file=sys.stderr)
    return wall, output


def status(env: dict[str, str], cwd: Path) -> dict[str, Any]:
    _, out = run([sys.executable, "-m", "cpq", "status", "--json"], cwd, env, 60)
    return dict(json.loads(out))


def torchrun_mode(project: Path, env: dict[str, str], mix: list[tuple[int, str]]) -> dict[str, Any]:
    walls, count = [], 0
    for ws, tag in mix:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ws)]
        cmd += ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *PLUGIN]
        cmd += ["-k", f"ws{ws}{tag}-"]
        wall, out = run(cmd, project, env)
        walls.append(wall)
        count += passed(out)
    return {"sessions": [{"wall_s": sum(walls), "passed": count, "per_world_size_s": walls}]}


def cpq_mode(project: Path, env: dict[str, str], state: Path, extra: list[str]) -> dict[str, Any]:
    env = dict(env, CPQ_STATE_DIR=str(state))
    sessions = []
    started_before = 0
    try:
        for _ in range(2):
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            cmd += ["-p", "no:randomly", *PLUGIN, *extra]
            wall, out = run(cmd, project, env)
            now = status(env, project)
            totals = now["totals"]
            ranks = [mb for p in now["pools"] if p["state"] == "idle" for mb in p["rss_mb"]]
            log = (state / "logs" / "broker.log").read_text()
            sessions.append(
                {
                    "wall_s": wall,
                    "passed": passed(out),
                    "groups_started": totals["groups_started"] - started_before,
                    "evictions_so_far": log.count("evicting "),
                    "rank_rss_mb": sorted(ranks)[len(ranks) // 2] if ranks else None,
                    "memory_used_mb": now["broker"].get("memory_used_mb"),
                }
            )
            started_before = totals["groups_started"]
    finally:
        subprocess.run([sys.executable, "-m", "cpq", "stop"], cwd=project, env=env, timeout=60)
    return {"sessions": sessions}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=12, help="tests per spec")
    parser.add_argument("--mix", default="1,2,4", help="specs: world sizes, ws:tag for more")
    parser.add_argument("--before", type=Path, help="a cpq checkout to compare with")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-placement-"))
    project = work / "project"
    project.mkdir()
    (project / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    mix = [(int(ws), tag) for ws, _, tag in (m.partition(":") for m in args.mix.split(","))]
    tests = TESTS.format(cases=args.cases, mix=mix)
    (project / "test_mixed.py").write_text(textwrap.dedent(tests))
    env = child_env()
    env.update(OMP_NUM_THREADS="1")
    results: dict[str, Any] = {
        "cases": len(mix) * args.cases,
        "mix": args.mix,
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"{results['cases']} tests (specs {args.mix} alternating), {results['cores']} cores")
    print(f"{'mode':<16}{'session':<9}{'wall s':>8}{'passed':>8}{'started':>9}{'evictions':>11}")
    modes = [("torchrun", None), ("cpq", []), ("cpq-keep-order", ["--cpq-keep-order"])]
    if args.before is not None:
        modes.append(("before", []))
    for mode, extra in modes:
        if extra is None:
            results[mode] = torchrun_mode(project, env, mix)
        else:
            mode_env = env
            if mode == "before":
                assert args.before is not None
                path = f"{args.before.resolve()}{os.pathsep}{env['PYTHONPATH']}"
                mode_env = dict(env, PYTHONPATH=path)
            results[mode] = cpq_mode(project, mode_env, work / f"state-{mode}", extra)
        for n, session in enumerate(results[mode]["sessions"]):
            name = "fresh" if mode == "torchrun" else ("cold", "warm")[n]
            started = session.get("groups_started", "-")
            evicted = session.get("evictions_so_far", "-")
            print(
                f"{mode:<16}{name:<9}{session['wall_s']:>8.1f}{session['passed']:>8}"
                f"{started:>9}{evicted:>11}",
                flush=True,
            )
        if args.json:  # after each mode: a run cut short keeps what it measured
            args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
