"""CI fan-out benchmark: the CP attention suite over two Slurm nodes vs one session, and the
arithmetic for Transformer Engine's 348-case CP matrix on 1/2/4/8 nodes.

    python tools/bench_fanout.py [--reps 3] [--json tools/results/bench_fanout.json]

Measured part. A real two-node Slurm cluster on this host (``tests/fanout/slurm.py``: two
slurmd, the same 2 cores). Each mode starts cold: its own broker is autostarted with its
state in a fresh directory, so the group spawn is inside every wall.

* one session: ``pytest tests/test_cp_attention.py`` here (the first run also writes the
  durations file the shards balance on);
* fan-out: ``sbatch --array=0-1 tools/ci/slurm/cpq-shards.sbatch`` with those durations;
  wall from ``sbatch`` until the array left the queue, each shard's wall and overhead
  (shard wall minus the sum of its tests' walls) from its manifest, ``cpq merge`` timed.

Both "nodes" share this machine's two cores, so the fan-out cannot be faster here than one
session: what this measures is what a shard costs (collection, broker, spawn, Slurm), not
the speed-up, which the arithmetic part works out from per-case GPU times.

Arithmetic part. ``tools/results/bench_te_gpu.json`` holds per-case times of 24 TE CP cases
on a warm ws=2 group of an H200 pair, the group's start time and the per-case cost of one
torchrun per case. 348 cases cycle through the 23 warm per-case times; a node of 8 GPUs runs
4 ws=2 groups (xdist -n 4); each group pays the first case's excess over a typical case once
(the group start collection did not hide, plus kernel warm-up), each node the GPU session's
overhead (its wall minus its cases) and, when fanned out, the Slurm start measured here.
The partition is cpq's own (:func:`cpq.fanout.shard.partition`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fanout"))

from slurm import SlurmCluster, wait_until  # noqa: E402

from cpq.fanout.shard import SPAWN_PREFIX, TestInfo, partition, planned_loads  # noqa: E402

SUITE = "tests/test_cp_attention.py"
PYTEST = ["-p", "cpq.client.plugin", "-p", "no:cacheprovider", "--noconftest", "-q"]


def clean_env(state: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(ROOT),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "CPQ_STATE_DIR": str(state),
    }


def one_session(work: Path, rep: int, durations: Path) -> dict[str, Any]:
    state = work / f"single-state-{rep}"
    state.mkdir(mode=0o700)
    env = clean_env(state)
    results = work / f"single-results-{rep}"
    command = [sys.executable, "-m", "pytest", *PYTEST, SUITE, "--cpq-results", str(results)]
    if rep == 0:
        command += ["--cpq-write-durations", "--cpq-durations", str(durations)]
    start = time.perf_counter()
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    subprocess.run([sys.executable, "-m", "cpq", "stop"], env=env, capture_output=True)
    if run.returncode:
        raise SystemExit(f"one session failed:\n{run.stdout}\n{run.stderr}")
    (manifest,) = [json.loads(p.read_text()) for p in results.glob("shard-*.json")]
    tests = sum(t["wall_s"] for t in manifest["tests"].values())
    return {"wall_s": round(wall, 2), "tests": len(manifest["tests"]), "tests_s": round(tests, 2)}


def fan_out(cluster: SlurmCluster, work: Path, rep: int, durations: Path) -> dict[str, Any]:
    results = work / f"fanout-results-{rep}"
    env = {
        "PYTHONPATH": str(ROOT),
        "CPQ_PYTHON": sys.executable,
        "CPQ_RESULTS": str(results),
        "CPQ_WORKDIR": str(ROOT),
        "CPQ_DURATIONS": str(durations),
        "TMPDIR": str(cluster.dir),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    start = time.perf_counter()
    out = cluster.run(
        "sbatch", "--parsable", "--array=0-1", f"--output={work}/fanout-{rep}-%a.out",
        str(ROOT / "tools/ci/slurm/cpq-shards.sbatch"), *PYTEST, SUITE, env=env,
    )  # fmt: skip
    job = out.strip().split(";")[0]
    wait_until(f"end of {job}", lambda: not cluster.queue(job), within=300, every=0.1)
    wall = time.perf_counter() - start
    merge_start = time.perf_counter()
    merged = subprocess.run(
        [sys.executable, "-m", "cpq", "merge", "--junit", str(work / f"junit-{rep}.xml"),
         str(results)],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
    )  # fmt: skip
    merge_s = time.perf_counter() - merge_start
    if merged.returncode:
        raise SystemExit(f"merge exit {merged.returncode}:\n{merged.stdout}\n{merged.stderr}")
    shards = []
    for path in sorted(results.glob("shard-*.json")):
        data = json.loads(path.read_text())
        tests_s = sum(t["wall_s"] for t in data["tests"].values())
        shards.append(
            {
                "shard": f"{data['index']}/{data['count']}",
                "node": data["hostname"],
                "tests": len(data["tests"]),
                "wall_s": data["wall_s"],
                "tests_s": round(tests_s, 2),
                "overhead_s": round(data["wall_s"] - tests_s, 2),
                "spawn_s": data["spawn_s"],
            }
        )
    walls = [s["wall_s"] for s in shards]
    in_process = float(merged.stdout.rsplit("merged in ", 1)[1].rstrip("s\n"))
    return {
        "wall_s": round(wall, 2),
        "shards": shards,
        "balance": round(max(walls) / min(walls), 3),
        "merge_process_s": round(merge_s, 3),
        "merge_in_process_s": in_process,
    }


def te_arithmetic(slurm_overhead_s: float) -> dict[str, Any]:
    """Transformer Engine's 348-case CP matrix on 1/2/4/8 nodes, from recorded GPU times."""
    data = json.loads((ROOT / "tools/results/bench_te_gpu.json").read_text())
    cases = [t["time_s"] for t in data["cpq"]["tests"]]
    first, warm = cases[0], cases[1:]
    # The first case waits for the group (what collection did not hide) and warms kernels:
    # its excess over a typical case is what each further group costs.
    group_cost = first - statistics.median(warm)
    # What a session costs beyond its cases (pytest start, collection, broker), measured
    # on the GPU host: the session's wall minus the sum of its cases.
    session_overhead = data["cpq"]["wall_s"] - sum(cases)
    torchrun_case = next(r["per_case_s"] for r in data["table"] if "measured" in r["mode"])
    groups_per_node = 4  # ws=2 on 8 GPUs: xdist -n 4 in each shard
    n_cases = 348
    per_case = [warm[i % len(warm)] for i in range(n_cases)]
    tests = [TestInfo(f"case{i:03d}", "ws2") for i in range(n_cases)]
    durations = {f"case{i:03d}": s for i, s in enumerate(per_case)}
    durations[SPAWN_PREFIX + "ws2"] = group_cost
    rows = []
    for nodes in (1, 2, 4, 8):
        # A node's 4 groups are 4 slots: cpq's partition over nodes x 4 slots, each slot
        # paying one group start, each node the session overhead (and Slurm's start, when
        # fanned out) once.
        shards = partition(tests, nodes * groups_per_node, durations)
        loads = planned_loads(tests, shards, durations)
        extra = session_overhead + (slurm_overhead_s if nodes > 1 else 0.0)
        node_walls = [
            extra + max(loads[n * groups_per_node : (n + 1) * groups_per_node])
            for n in range(nodes)
        ]
        torchrun = n_cases * torchrun_case / (nodes * groups_per_node)
        rows.append(
            {
                "nodes": nodes,
                "cpq_wall_s": round(max(node_walls), 1),
                "balance": round(max(node_walls) / min(node_walls), 3),
                "torchrun_per_case_wall_s": round(torchrun, 1),
                "speedup_vs_torchrun": round(torchrun / max(node_walls), 1),
            }
        )
    return {
        "cases": n_cases,
        "warm_case_s": {
            "median": statistics.median(warm),
            "mean": round(statistics.fmean(warm), 3),
        },
        "group_cost_s": round(group_cost, 2),
        "session_overhead_s": round(session_overhead, 2),
        "slurm_overhead_s": slurm_overhead_s,
        "torchrun_per_case_s": torchrun_case,
        "groups_per_node": groups_per_node,
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cpq-bf-"))
    work.chmod(0o755)  # munged (another user) must reach its socket under it
    cluster = SlurmCluster(work / "c")
    (work / "c").mkdir()
    durations = work / "durations.json"
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_before": os.getloadavg()[0],
        },
        "suite": SUITE,
    }
    try:
        cluster.start()
        single = [one_session(work, rep, durations) for rep in range(args.reps)]
        fan = [fan_out(cluster, work, rep, durations) for rep in range(args.reps)]
    finally:
        left = cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    if left:
        print(f"warning: killed leftover processes {left}", file=sys.stderr)
    overheads = [s["overhead_s"] for f in fan for s in f["shards"]]
    slurm = [f["wall_s"] - max(s["wall_s"] for s in f["shards"]) for f in fan]
    out |= {
        "one_session": single,
        "fan_out": fan,
        "summary": {
            "one_session_wall_s_median": statistics.median(s["wall_s"] for s in single),
            "fan_out_wall_s_median": statistics.median(f["wall_s"] for f in fan),
            "shard_overhead_s_median": statistics.median(overheads),
            "balance_median": statistics.median(f["balance"] for f in fan),
            "merge_process_s_median": statistics.median(f["merge_process_s"] for f in fan),
            "slurm_overhead_s_median": round(statistics.median(slurm), 2),
        },
    }
    out["te_348"] = te_arithmetic(out["summary"]["slurm_overhead_s_median"])
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
