"""Benchmark: how long a test waits after its group had to be replaced, with and without spares.

Why this exists (issue 15): every event that replaces a warm group — an edit of the user's
code, a failure that leaves a rank stuck (the group is recycled) — used to make the next
test wait for a whole spawn. With ``--spares 1`` the broker keeps one clean group per used
spec and the next test takes it at once. Three measurements, each on a fresh private broker
per mode (``--spares 1`` and ``--spares 0``), ws=2 gloo:

* ``edit``: a task imports a helper module; the helper is edited; the *wait* of the next
  task = its round trip seen by the client minus its time on the rank (``--reps`` times;
  before each edit the broker is given time to have its spare ready, as between two runs of
  an edit-and-rerun loop);
* ``failure``: a task fails on rank 0 while rank 1 waits in a collective (stuck: the broker
  recycles the group after ``--failure-grace 1``); the wait of the next task, likewise;
* ``suite``: one cold pytest session of 40 CP attention cases (``workers.cp_attention``,
  ``tests/test_cp_attention.py``-style markers) of which 4 (10 %) fail on rank 0 while
  rank 1 is stuck in the case's first collective: wall, and the summed and largest queue
  waits from the broker's timing history.

* ``full box`` (``--full-box``, issue 20): ``--max-ranks 3`` cores, a ws=1 and a ws=2
  group; spares held in memory (idle CPU ranks cost memory within ``--memory``, issue 29)
  against no spares (``--spares 0``: before issue 20, no spare fit the cores). The wait of
  the ws=2 task after each helper edit, the spawn the broker says it waited for
  (``spawn_wait_s``), and what the CPU groups held.

Usage: ``python tools/bench_spares.py [--reps 3] [--full-box] [--json ...]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_core import cpu_model  # noqa: E402
from benchkit import PrivateBroker, child_env, run_logged  # noqa: E402

from cpq import Client  # noqa: E402
from cpq.timings import TIMINGS_FILE  # noqa: E402

TARGETS = """
import time

import torch.distributed as dist

from bench_helper import value


def read():
    return value()


def fail_while_a_peer_hangs():
    if dist.get_rank() == 0:
        raise AssertionError("rank 0 fails")
    time.sleep(300)  # rank 1 is stuck: the broker recycles the group
"""

SUITE = '''
"""40 CP attention cases; every tenth fails on rank 0 while rank 1 waits in a collective."""
import pytest
import torch.distributed as dist

from workers.cp_attention import CASES, run_cp_attention


@pytest.mark.cpq(world_size=2, timeout=120)
@pytest.mark.parametrize("i", range(40))
def test_cp_case(i):
    if i % 10 == 9 and dist.get_rank() == 0:
        raise AssertionError("injected failure on rank 0")
    run_cp_attention(**CASES[i % len(CASES)])
'''

FAILURE_GRACE = ("--failure-grace", "1")


def _in_task(result: Any) -> float:
    return max((r.duration_s for r in result.ranks), default=0.0)


def timed_submit(client: Client, function: str, ws: int, project: Path) -> tuple[Any, float]:
    """A task of ``bench_targets`` and its round trip as the client sees it."""
    started = time.perf_counter()
    result = client.submit(f"bench_targets:{function}", ws, roots=[str(project)], timeout=60)
    return result, time.perf_counter() - started


def _wait_for_spare(client: Client, spares: bool, within: float = 180.0) -> None:
    """Until the pool is at rest: an idle spare (with spares), else every group idle."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        pools = client.status()["pools"]
        if spares and any(p["spare"] and p["state"] == "idle" for p in pools):
            return
        if not spares and pools and all(p["state"] == "idle" for p in pools):
            return
        time.sleep(0.1)
    raise TimeoutError("the pool did not come to rest")


def replace_waits(work: Path, spares: bool, reps: int, env: dict[str, str]) -> dict[str, Any]:
    """The ``edit`` and ``failure`` measurements on one private broker."""
    mode = "spares" if spares else "nospares"
    project = work / f"project-{mode}"
    project.mkdir()
    (project / "bench_targets.py").write_text(textwrap.dedent(TARGETS))
    helper = project / "bench_helper.py"
    helper.write_text("def value():\n    return 0\n")
    broker = PrivateBroker(
        work / f"state-{mode}",
        work / f"logs-{mode}",
        "none",
        env,
        ("--spares", "1" if spares else "0", *FAILURE_GRACE),
    )
    edit: list[float] = []
    failure: list[float] = []
    try:
        with Client(broker.endpoint, name="bench_spares") as client:

            def run(function: str) -> tuple[Any, float]:
                return timed_submit(client, function, 2, project)

            assert run("read")[0].outcome == "passed"
            for n in range(1, reps + 1):
                _wait_for_spare(client, spares)
                helper.write_text(f"def value():\n    return {n}\n")
                # Saved a second ago, as by an editor before the rerun (a file modified
                # within 50 ms before the task that imports it counts as changed at once).
                saved = time.time_ns() - 1_000_000_000
                os.utime(helper, ns=(saved, saved))
                result, wall = run("read")
                assert result.outcome == "passed" and result.value == n, result
                edit.append(wall - _in_task(result))
            for _ in range(reps):
                _wait_for_spare(client, spares)
                failed, _ = run("fail_while_a_peer_hangs")
                assert failed.outcome == "failed" and "recycled" in failed.message, failed
                result, wall = run("read")
                assert result.outcome == "passed", result
                failure.append(wall - _in_task(result))
            totals = client.status()["totals"]
    finally:
        broker.stop()
    return {
        "edit_wait_s": edit,
        "failure_wait_s": failure,
        "groups_started": totals["groups_started"],
    }


def full_box_waits(work: Path, memory: bool, reps: int, env: dict[str, str]) -> dict[str, Any]:
    """The ``full box`` measurement: edits on a --max-ranks 3 box full of a ws=1 and a ws=2
    group, spares held in memory (``memory``) or none (``--spares 0``)."""
    mode = "memory" if memory else "cores"
    project = work / f"project-box-{mode}"
    project.mkdir()
    (project / "bench_targets.py").write_text(textwrap.dedent(TARGETS))
    helper = project / "bench_helper.py"
    helper.write_text("def value():\n    return 0\n")
    extra = ("--max-ranks", "3") + (() if memory else ("--spares", "0"))
    broker = PrivateBroker(
        work / f"state-box-{mode}", work / f"logs-box-{mode}", "none", env, extra
    )
    waits: list[float] = []
    spawn_waits: list[float] = []
    held: list[float] = []
    try:
        with Client(broker.endpoint, name="bench_spares") as client:

            def run(ws: int) -> tuple[Any, float]:
                return timed_submit(client, "read", ws, project)

            for ws in (1, 2):
                assert run(ws)[0].outcome == "passed"
            for n in range(1, reps + 1):
                deadline = time.monotonic() + 180
                while time.monotonic() < deadline:  # at rest: what would start has started
                    status = client.status()
                    pools = status["pools"]
                    spares = {p["world_size"] for p in pools if p["spare"] and p["state"] == "idle"}
                    if all(p["state"] == "idle" for p in pools) and (
                        not memory or spares == {1, 2}
                    ):
                        break
                    time.sleep(0.1)
                else:
                    raise TimeoutError("the pool did not come to rest")
                held.append(status["broker"].get("memory_used_mb", 0.0))
                helper.write_text(f"def value():\n    return {n}\n")
                saved = time.time_ns() - 1_000_000_000
                os.utime(helper, ns=(saved, saved))
                result, wall = run(2)
                assert result.outcome == "passed" and result.value == n, result
                waits.append(wall - _in_task(result))
                spawn_waits.append(result.spawn_wait_s)
    finally:
        broker.stop()
    return {"edit_wait_s": waits, "spawn_wait_s": spawn_waits, "memory_used_mb": held}


def suite(work: Path, spares: bool, env: dict[str, str]) -> dict[str, Any]:
    """The ``suite`` measurement: one cold pytest session on a fresh broker."""
    mode = "spares" if spares else "nospares"
    project = work / f"suite-{mode}"
    project.mkdir()
    (project / "test_cp_suite.py").write_text(SUITE)
    broker = PrivateBroker(
        work / f"sstate-{mode}",
        work / f"slogs-{mode}",
        "none",
        env,
        ("--spares", "1" if spares else "0", *FAILURE_GRACE),
    )
    try:
        session_env = dict(broker.env, CPQ_AUTOSTART="0", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "cpq.client.plugin",
            "-p",
            "no:cacheprovider",
        ]
        command.append(str(project / "test_cp_suite.py"))
        run = run_logged(command, work / f"suite-{mode}.log", session_env, project, 900)
        totals = broker.status()["totals"]
    finally:
        broker.stop()
    rows = [json.loads(line) for line in (broker.state / TIMINGS_FILE).read_text().splitlines()]
    queue = [row["queue_s"] for row in rows]
    outcomes = [row["outcome"] for row in rows]
    return {
        "rc": run.rc,
        "wall_s": run.wall_s,
        "passed": outcomes.count("passed"),
        "failed": outcomes.count("failed"),
        "queue_sum_s": sum(queue),
        "queue_max_after_first_s": max(queue[1:]) if len(queue) > 1 else 0.0,
        "groups_started": totals["groups_started"],
        "groups_recycled": totals["groups_recycled"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-suite", action="store_true")
    parser.add_argument(
        "--full-box", action="store_true", help="only the full-box measurement (issue 20)"
    )
    parser.add_argument(
        "--json", type=Path, default=ROOT / "tools" / "results" / "bench_spares.json"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cpqs-"))  # short: ipc paths have a length limit
    env = child_env()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, {cpu_model()}, no GPU",
        "load_average_at_start": os.getloadavg()[0],
        "command": f"python tools/bench_spares.py --reps {args.reps}",
    }
    if args.full_box:
        results["command"] += " --full-box"
        for memory in (True, False):
            box = full_box_waits(work, memory, args.reps, env)
            results["box_memory" if memory else "box_cores"] = box
            print(
                f"  {'spares in memory' if memory else 'no spares'}: ws=2 edit waits "
                + ", ".join(f"{w:.2f}" for w in box["edit_wait_s"])
                + " s; spawn waits "
                + ", ".join(f"{w:.2f}" for w in box["spawn_wait_s"])
                + f" s; CPU groups held {max(box['memory_used_mb']):.0f} MB"
            )
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"written to {args.json}")
        return 0
    for spares in (True, False):
        mode = "spares" if spares else "nospares"
        results[mode] = replace_waits(work, spares, args.reps, env)
        if not args.skip_suite:
            results[mode]["suite"] = suite(work, spares, env)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\ncpq spares benchmark — {results['machine']}, logs in {work}")
    for mode in ("spares", "nospares"):
        r = results[mode]
        print(
            f"  {mode:9s} edit wait median {statistics.median(r['edit_wait_s']):.3f} s "
            f"(max {max(r['edit_wait_s']):.3f}); failure wait median "
            f"{statistics.median(r['failure_wait_s']):.3f} s (max {max(r['failure_wait_s']):.3f})"
        )
        if "suite" in r:
            s = r["suite"]
            print(
                f"            suite: wall {s['wall_s']:.1f} s, {s['passed']} passed, "
                f"{s['failed']} failed, queue sum {s['queue_sum_s']:.1f} s, "
                f"largest wait after the first {s['queue_max_after_first_s']:.2f} s, "
                f"{s['groups_started']} groups started"
            )
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
