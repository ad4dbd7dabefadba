"""Core speed benchmark: round trip, throughput and group start of one broker.

Starts a private ``cpq-broker``, then on one ws=2 gloo group measures:

* spawn → ready: how long a new group takes before it can take a task (and the first
  task's wall time including that spawn);
* round trip of a no-op task, one at a time (p50 / p90 / p99 / max);
* throughput with 1 and with 8 tasks in flight (``Client.submit_async``);
* the same no-op round trip through ``tools/stdio_pool.py`` (a Transformer-Engine-style pool
  fed JSON on stdin, no broker in the middle), measured in the same run, alternating with
  cpq in blocks so both see the same load on a shared machine (``--no-stdio`` skips it);
* the CPU time (every thread, user and system) that the client, the broker, the agent and
  each rank spend per no-op task: the code's own cost, which a loaded machine's wall times
  hide;
* the code-freshness check every rank runs before every task (``cpq.rank.freshness``),
  timed in this process over the files a rank of this benchmark watches (cpq, the
  workload module, the site-packages directories).

Usage: ``python tools/bench_core.py [--tasks 2000] [--json tools/results/bench_core.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

STARTED_NS = time.time_ns()  # before any cpq module is imported (for the freshness check)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "tools"))

from benchkit import cpu_broker  # noqa: E402

from cpq import Client, TaskResult  # noqa: E402

NOOP = "workers.collectives:noop"
#: cpq and the stdio pool take turns, this many tasks each, so both see the same load.
BLOCK = 100


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def throughput(client: Client, tasks: int, in_flight: int) -> float:
    window: deque[Future[TaskResult]] = deque()
    start = time.perf_counter()
    for _ in range(tasks):
        if len(window) >= in_flight:
            assert window.popleft().result().outcome == "passed"
        window.append(client.submit_async(NOOP, 2, roots=[str(ROOT)]))
    while window:
        assert window.popleft().result().outcome == "passed"
    return tasks / (time.perf_counter() - start)


def cpu_per_task(client: Client, broker_pid: int, tasks: int) -> dict[str, float]:
    """CPU time (user + system, every thread) each process spends per no-op round trip,
    over ``tasks`` more of them: this process (the client), the broker, and every group's
    torchrun agent and ranks (numbered in the broker's order; an idle spare's show ~0).
    It is the code's own cost. On a loaded machine it moves less than the wall time: three
    runs on the 2-core VM gave the broker 700-850 us."""
    import psutil

    def processes() -> dict[str, psutil.Process]:
        found = {"client": psutil.Process(), "broker": psutil.Process(broker_pid)}
        for child in found["broker"].children(recursive=True):
            line = " ".join(child.cmdline())  # an agent's line names cpq.rank too
            if "cpq.rank.launch" in line:  # torchrun behind cpq's lease wrapper
                found[f"agent{len([k for k in found if k.startswith('agent')])}"] = child
            elif "cpq.rank" in line:
                found[f"rank{len([k for k in found if k.startswith('rank')])}"] = child
        return found

    def seconds(proc: psutil.Process) -> float:
        times = proc.cpu_times()
        return float(times.user + times.system)

    watched = processes()
    before = {name: seconds(proc) for name, proc in watched.items()}
    for _ in range(tasks):
        client.submit(NOOP, 2, roots=[str(ROOT)])
    return {name: (seconds(proc) - before[name]) / tasks * 1e6 for name, proc in watched.items()}


def stdio_pool() -> Any:
    """A started ``tools/stdio_pool.py`` pool (ws=2 gloo), warmed with 50 no-ops."""
    sys.path.insert(0, str(ROOT / "tools"))
    from stdio_pool import StdioPool

    pool = StdioPool(2, cwd=str(ROOT), env={"STDIO_POOL_BACKEND": "gloo"})
    pool.__enter__()
    for _ in range(50):
        pool.run(NOOP)
    return pool


def stdio_round_trips(pool: Any, tasks: int) -> list[float]:
    """Round trips (s) of ``tasks`` no-ops through the stdio pool."""
    out = []
    for _ in range(tasks):
        t0 = time.perf_counter()
        result = pool.run(NOOP)
        out.append(time.perf_counter() - t0)
        assert result["outcome"] == "passed", result
    return out


def summary_ms(round_trips: list[float]) -> dict[str, float]:
    ms = [t * 1000 for t in round_trips]
    return {
        "p50": statistics.median(ms),
        "p90": percentile(ms, 0.90),
        "p99": percentile(ms, 0.99),
        "max": max(ms),
        "mean": statistics.fmean(ms),
    }


def freshness_check_us(rounds: int = 2000) -> tuple[float, int]:
    """``(microseconds per check, files watched)`` for a rank that imported what ours did."""
    import workers.collectives  # noqa: F401  - the benchmark's workload, as a rank loads it
    from cpq.rank.freshness import CodeWatch

    watch = CodeWatch()
    watch.scan(STARTED_NS)
    assert watch.changed() == "", watch.changed()
    started = time.perf_counter()
    for _ in range(rounds):
        watch.changed()
    return (time.perf_counter() - started) / rounds * 1e6, len(watch.files)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=ROOT / "tools" / "results" / "bench_core.json")
    parser.add_argument("--no-stdio", action="store_true", help="skip the stdio pool")
    parser.add_argument(
        "--broker-arg", action="append", default=[], help="passed to cpq-broker (repeatable)"
    )
    args = parser.parse_args()
    pool = None if args.no_stdio else stdio_pool()
    stdio: list[float] = []

    try:
        with (
            cpu_broker("cpq-bench-", *args.broker_arg) as (endpoint, broker),
            Client(endpoint, name="bench_core") as client,
        ):
            started = time.perf_counter()
            first = client.submit(NOOP, 2, roots=[str(ROOT)])
            first_wall = time.perf_counter() - started
            assert first.outcome == "passed", first
            ready_after = client.status()["pools"][0]["ready_after_s"]
            # Steady state: a spare the broker starts in the background (issue 15) must not
            # spawn during the measurement.
            while any(p["state"] == "starting" for p in client.status()["pools"]):
                time.sleep(0.1)
            for _ in range(50):  # warm the path (allocators, caches) before measuring
                client.submit(NOOP, 2, roots=[str(ROOT)])
            round_trips = []
            parts: dict[str, list[float]] = {"client": [], "broker": [], "hops": [], "rank": []}
            for i in range(args.tasks):
                if pool is not None and i % BLOCK == 0:  # the pool's block, then cpq's
                    stdio += stdio_round_trips(pool, min(BLOCK, args.tasks - i))
                t0 = time.perf_counter()
                result = client.submit(NOOP, 2, roots=[str(ROOT)])
                round_trips.append(time.perf_counter() - t0)
                assert result.outcome == "passed"
                # Where it went: the rank's run_task (reset, capture, call), the hops from
                # the broker's dispatch to its verdict beyond that, the broker's queueing,
                # and the rest (client threads, client <-> broker sockets).
                rank = max(r.duration_s for r in result.ranks)
                parts["rank"].append(rank)
                parts["hops"].append(result.duration_s - rank)
                parts["broker"].append(result.queue_s)
                parts["client"].append(round_trips[-1] - result.duration_s - result.queue_s)
            cpu_us = cpu_per_task(client, broker.pid, args.tasks)
            rate_1 = throughput(client, args.tasks, 1)
            rate_8 = throughput(client, args.tasks, 8)
            groups = client.status()["totals"]["groups_started"]
    finally:
        if pool is not None:
            pool.__exit__(None, None, None)

    check_us, watched = freshness_check_us()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {cpu_model()}, no GPU",
        "python": platform.python_version(),
        "command": "python tools/bench_core.py --tasks " + str(args.tasks),
        "tasks": args.tasks,
        "group_ready_s": ready_after,
        "first_task_wall_s": first_wall,
        "round_trip_ms": summary_ms(round_trips),
        "round_trip_breakdown_p50_ms": {
            "client threads and client<->broker sockets": statistics.median(parts["client"]) * 1e3,
            "broker: submit -> dispatch": statistics.median(parts["broker"]) * 1e3,
            "broker <-> ranks (I/O threads, hand-off, report)": statistics.median(parts["hops"])
            * 1e3,
            "rank run_task (reset, capture, call)": statistics.median(parts["rank"]) * 1e3,
        },
        "cpu_us_per_task": cpu_us,
        "stdio_pool_round_trip_ms": summary_ms(stdio) if stdio else None,
        "throughput_per_s": {"in_flight_1": rate_1, "in_flight_8": rate_8},
        "groups_started": groups,
        "freshness_check": {"us_per_task": check_us, "files_watched": watched},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    rt = results["round_trip_ms"]
    sp = results["stdio_pool_round_trip_ms"]
    rows = [
        ("group spawn -> ready (ws=2 gloo)", f"{ready_after:.2f} s"),
        ("first task incl. spawn", f"{first_wall:.2f} s"),
        ("no-op round trip p50", f"{rt['p50']:.3f} ms"),
        ("no-op round trip p90", f"{rt['p90']:.3f} ms"),
        ("no-op round trip p99", f"{rt['p99']:.3f} ms"),
        ("no-op round trip max", f"{rt['max']:.3f} ms"),
        *(
            [
                ("stdio pool no-op round trip p50", f"{sp['p50']:.3f} ms"),
                ("stdio pool no-op round trip p99", f"{sp['p99']:.3f} ms"),
                ("cpq p50 / stdio pool p50", f"{rt['p50'] / sp['p50']:.2f}"),
            ]
            if sp
            else []
        ),
        *(
            (f"  p50 of: {k}", f"{v:.3f} ms")
            for k, v in results["round_trip_breakdown_p50_ms"].items()
        ),
        *((f"  CPU per task: {k}", f"{v:.0f} us") for k, v in cpu_us.items()),
        ("throughput, 1 in flight", f"{rate_1:.0f} tasks/s"),
        ("throughput, 8 in flight", f"{rate_8:.0f} tasks/s"),
        ("groups started", str(groups)),
        (f"code-freshness check ({watched} files)", f"{check_us:.1f} us per task"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\ncpq core benchmark — {results['machine']}, {args.tasks} tasks")
    for name, value in rows:
        print(f"  {name.ljust(width)}  {value}")
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
