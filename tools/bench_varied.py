"""A varied stretch of use on one broker: how many groups, processes and memory it holds.

Issue 37 found an idle broker holding 16 groups, 49 processes and 7.9 GB after 45 minutes
of a small project's launches from a shell, serial pytest and ``-n 2``. This replays that
kind of use on a private broker with its default options (``--idle-release`` aside, which
``--idle-release`` sets): a small project whose tests launch ``torchrun script.py`` and whose
other tests run on the ranks, in a seeded random order of activities —

* ``serial``: ``pytest --cpq-torchrun`` (4 launches, ws=2);
* ``xdist``: the same under ``-n 2``;
* ``shell``: three ``cpq torchrun`` launches from a shell;
* ``ranks2`` / ``ranks1``: ``pytest --cpq-world-size 2`` / ``1`` on the ranks' tests;
* ``edit``: the project's helper module (imported by the script and the tests) edited;
* ``debugvar``: a shell launch with ``TORCH_SHOW_CPP_STACKTRACES=1`` (a start variable: a
  spec of its own, as a user debugging one failure makes);

— until ``--minutes`` have passed, sampling the broker after every activity (groups by
state, rank processes, their resident memory); then it waits ``--wait`` seconds idle and
samples once more (idle groups beyond each spec's last used one go after
``--idle-release`` seconds; groups whose code changed go when idle).

    python tools/bench_varied.py [--minutes 60] [--idle-release 900] [--wait 960] [--seed 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import PrivateBroker, child_env, plugin_args

HELPER = "VERSION = {version}\n"
SCRIPT = """
import sys

import torch
import torch.distributed as dist

import helper

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"RANK {dist.get_rank()} SUM {t.item()} VERSION {helper.VERSION} {sys.argv[1:]}")
dist.destroy_process_group()
"""
LAUNCHING = """
import subprocess

import pytest


@pytest.mark.parametrize("case", range(4))
def test_launch(case):
    done = subprocess.run(["torchrun", "--nproc-per-node", "2", "script.py", str(case)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
"""
RANKS = """
import torch
import torch.distributed as dist

import helper


def test_sum():
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size() and helper.VERSION >= 0


def test_rank():
    assert 0 <= dist.get_rank() < dist.get_world_size()
"""


def activities(project: Path, env: dict[str, str]) -> dict[str, Any]:
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin_args()]
    launch = [sys.executable, "-m", "cpq", "torchrun", "--nproc-per-node", "2", "script.py"]
    version = [0]

    def run(command: list[str], extra_env: dict[str, str] | None = None) -> int:
        done = subprocess.run(
            command, cwd=project, env=dict(env, **(extra_env or {})), capture_output=True
        )
        return done.returncode

    def edit() -> int:
        version[0] += 1
        (project / "helper.py").write_text(HELPER.format(version=version[0]))
        return 0

    return {
        "serial": lambda: run([*pytest_cmd, "--cpq-torchrun", "test_launching.py"]),
        "xdist": lambda: run([*pytest_cmd, "--cpq-torchrun", "-n", "2", "test_launching.py"]),
        "shell": lambda: max(run([*launch, str(i)]) for i in range(3)),
        "ranks2": lambda: run([*pytest_cmd, "--cpq-world-size", "2", "test_ranks.py"]),
        "ranks1": lambda: run([*pytest_cmd, "--cpq-world-size", "1", "test_ranks.py"]),
        "edit": edit,
        "debugvar": lambda: run([*launch, "dbg"], {"TORCH_SHOW_CPP_STACKTRACES": "1"}),
    }


def sample(broker: PrivateBroker) -> dict[str, Any]:
    import psutil

    status = broker.status()
    pools = status["pools"]
    states: dict[str, int] = {}
    for pool in pools:
        states[pool["state"]] = states.get(pool["state"], 0) + 1
    tree = psutil.Process(broker.process.pid).children(recursive=True)
    rss = 0
    for proc in tree:
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            rss += proc.memory_info().rss
    return {
        "groups": len(pools),
        "states": states,
        "specs": len({p["spec_id"] for p in pools}),
        "processes": len(tree),
        "rss_gb": rss / 2**30,
        "groups_started": status["totals"]["groups_started"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--idle-release", type=float, default=900)
    parser.add_argument("--wait", type=float, default=None, help="idle seconds at the end")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    wait = args.idle_release + 60 if args.wait is None else args.wait
    work = Path(tempfile.mkdtemp(prefix="bench-varied-"))
    project = work / "project"
    project.mkdir()
    (project / "helper.py").write_text(HELPER.format(version=0))
    (project / "script.py").write_text(SCRIPT)
    (project / "test_launching.py").write_text(LAUNCHING)
    (project / "test_ranks.py").write_text(RANKS)
    broker = PrivateBroker(
        work / "state",
        work / "logs",
        "none",
        child_env(),
        ("--idle-release", str(args.idle_release)),
    )
    env = dict(broker.env, CPQ_AUTOSTART="0")
    todo = activities(project, env)
    rng = random.Random(args.seed)
    samples: list[dict[str, Any]] = []
    failures = 0
    started = time.monotonic()
    try:
        while time.monotonic() - started < args.minutes * 60:
            name = rng.choice(sorted(todo))
            rc = todo[name]()
            failures += rc != 0
            row = sample(broker)
            row.update(activity=name, rc=rc, at_min=(time.monotonic() - started) / 60)
            samples.append(row)
            print(
                f"{row['at_min']:6.1f} min  {name:8s} rc {rc}  groups {row['groups']} "
                f"{row['states']}  specs {row['specs']}  processes {row['processes']}  "
                f"rss {row['rss_gb']:.2f} GB  started {row['groups_started']}",
                flush=True,
            )
        time.sleep(wait)
        final = sample(broker)
    finally:
        broker.stop()
    peak = max(samples, key=lambda r: r["rss_gb"])
    most = max(samples, key=lambda r: r["groups"])
    summary = {
        "activities": len(samples),
        "failed_activities": failures,
        "minutes": args.minutes,
        "idle_release_s": args.idle_release,
        "most_groups": most["groups"],
        "peak_rss_gb": peak["rss_gb"],
        "last": samples[-1] if samples else None,
        f"after_{wait:.0f}s_idle": final,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
