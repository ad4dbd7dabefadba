"""GPU leases on a CPU machine (fake GPUs): the cost of leasing per group start, and the
yield latency between two brokers.

1. **Leasing cost**: ``Leases.take`` + ``drop`` for ws=1, 2 and 8 GPUs in a lease directory
   on the node's ``/run/lock`` (tmpfs), as a group start pays it: per GPU an ``open``, an
   ``flock``, a ``stat`` and an ``fstat``, then a ``close`` when the group stops. Measured
   in process, ``--reps`` times.
2. **Yield latency**: two real brokers with ``--gpus fake:2`` on one lease directory. Each
   cycle, broker X has an idle ws=2 group on both GPUs; broker Y's client submits a ws=2
   task at t0. Measured from t0: ``freed`` (the lease of both GPUs is free: Y's want was
   read, X stopped its idle group and its ranks exited; polled every 2 ms), ``started``
   (Y's rank began the task), and Y's group spawn (``ready_after_s``). ``started - spawn``
   is what the contract bounds by 2 s. The brokers swap roles every cycle.

    python tools/bench_leases.py [--cycles 8] [--reps 2000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpq import Client  # noqa: E402
from cpq.broker import leasedir  # noqa: E402
from cpq.broker.inventory import fake  # noqa: E402
from cpq.broker.leases import Leases  # noqa: E402
from cpq.client.autostart import broker_alive  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def leasing_cost(directory: Path, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ws in (1, 2, 8):
        leases = Leases(directory, fake(8).uuids, "bench")
        leases.prepare([str(i) for i in range(8)])
        gpus = [str(i) for i in range(ws)]
        take, drop = [], []
        for i in range(reps):
            t0 = time.perf_counter()
            got = leases.take(gpus, ws, since=float("inf"), now=float(i))
            t1 = time.perf_counter()
            assert got == gpus
            leases.drop(gpus)
            t2 = time.perf_counter()
            take.append(t1 - t0)
            drop.append(t2 - t1)
        out[f"ws{ws}"] = {
            "take_us_p50": statistics.median(take) * 1e6,
            "take_us_p95": pct(take, 0.95) * 1e6,
            "drop_us_p50": statistics.median(drop) * 1e6,
        }
    return out


def start_broker(base: Path, name: str, leases: Path) -> tuple[subprocess.Popen[bytes], str]:
    state = base / name
    state.mkdir(mode=0o700)
    endpoint = f"ipc://{state / 'broker.sock'}"
    command = [sys.executable, "-m", "cpq.broker", "--endpoint", endpoint]
    command += ["--gpus", "fake:2", "--gpu-leases", str(leases), "--spares", "0"]
    env = dict(os.environ, CPQ_STATE_DIR=str(state))
    log = open(base / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    while not broker_alive(endpoint):
        time.sleep(0.05)
    return process, endpoint


def yield_latency(base: Path, cycles: int) -> list[dict[str, float]]:
    leases = base / "leases"
    records = base / "records.jsonl"
    records.touch()
    brokers = [start_broker(base, name, leases) for name in ("x", "y")]
    out = []
    try:
        kwargs = {"path": str(records), "tag": "warm"}
        with Client(brokers[0][1]) as client:  # the first holder
            assert client.submit("workers.gpu_usage:record", 2, kwargs).outcome == "passed"
        for cycle in range(cycles):
            waiter = brokers[(cycle + 1) % 2][1]
            tag = f"c{cycle}"
            done: dict[str, Any] = {}

            def submit(endpoint: str = waiter, tag: str = tag, done: dict[str, Any] = done) -> None:
                with Client(endpoint) as client:
                    args = {"path": str(records), "tag": tag}
                    done["r"] = client.submit("workers.gpu_usage:record", 2, args, timeout=300)

            t0 = time.time()
            thread = threading.Thread(target=submit)
            thread.start()
            freed = None
            while freed is None:
                if not any(leasedir.is_held(leases, f"GPU-fake-{i}") for i in (0, 1)):
                    freed = time.time() - t0
                time.sleep(0.002)
            thread.join()
            assert done["r"].outcome == "passed", done["r"]
            rows = [json.loads(x) for x in records.read_text().splitlines() if x.strip()]
            started = min(r["t"] for r in rows if r["tag"] == tag) - t0
            with Client(waiter) as client:
                spawn = client.status()["pools"][0]["ready_after_s"]
            out.append({"freed_s": freed, "started_s": started, "spawn_s": spawn})
            print(f"cycle {cycle}: {out[-1]}", flush=True)
    finally:
        for process, _ in brokers:
            process.terminate()
        for process, _ in brokers:
            process.wait(30)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="cpq-bench-leases-", dir="/run/lock"))
    try:
        cost = leasing_cost(base / "cost", args.reps)
        cycles = yield_latency(base, args.cycles)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    freed = [c["freed_s"] for c in cycles]
    beyond = [c["started_s"] - c["spawn_s"] for c in cycles]
    summary = {
        "host": socket.gethostname(),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "leasing_cost": cost,
        "yield_freed_s_p50": statistics.median(freed),
        "yield_freed_s_p95": pct(freed, 0.95),
        "start_minus_spawn_s_p50": statistics.median(beyond),
        "start_minus_spawn_s_p95": pct(beyond, 0.95),
        "spawn_s_p50": statistics.median(c["spawn_s"] for c in cycles),
        "cycles": cycles,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "cycles"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
