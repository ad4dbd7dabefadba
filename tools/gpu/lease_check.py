"""Two brokers, one GPU: node-wide GPU leases on real hardware (issue 22).

Starts two ``cpq-broker`` processes (separate state directories, one lease directory, both
given the same one GPU), samples ``nvidia-smi`` every 0.2 s, and runs:

1. broker A: a ws=1 task that holds 256 MB on the GPU for ``--hold`` seconds
   (``workers.gpu_usage:record touch=True``); its group stays warm (idle) afterwards;
2. broker B, while A's task runs: the same task. B must wait while A's group is busy, and
   start once A's group is idle (A yields it within two ticks, B spawns on the freed GPU).

Prints a short table: whether any sample showed ranks of both brokers on the GPU at once
(must be "no"), whether A's task ran undisturbed, B's yield latency (A's task end -> B's
task start, and the part of it that was B's spawn), and the samples taken. Exit status 0
when no overlap was seen and both tasks passed.

Run from the repository root on a GPU host (pyzmq, msgpack, psutil and torch importable;
see tools/gpu/README.md, "GPU leases"):

    python tools/gpu/lease_check.py [--gpu 0] [--hold 6] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cpq import Client  # noqa: E402
from cpq.client.autostart import broker_alive  # noqa: E402

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def gpu_uuid(index: str) -> str:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in out.splitlines():
        i, _, uuid = (p.strip() for p in line.partition(","))
        if i == index:
            return uuid
    raise SystemExit(f"nvidia-smi lists no GPU {index}")


def apps_on(uuid: str) -> list[int]:
    """pids of the compute processes on GPU ``uuid`` now."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout
    pids = []
    for line in out.splitlines():
        pid, _, on = (p.strip() for p in line.partition(","))
        if on == uuid and pid.isdigit():
            pids.append(int(pid))
    return pids


def owner(pid: int, brokers: dict[str, int]) -> str:
    """Which broker ``pid`` descends from ("?" when its ancestry cannot be read, e.g. the
    pid is from another pid namespace)."""
    try:
        import psutil

        for parent in psutil.Process(pid).parents():
            for name, broker_pid in brokers.items():
                if parent.pid == broker_pid:
                    return name
    except Exception:
        return "?"
    return "?"


def start_broker(name: str, base: Path, gpu: str, leases: Path) -> subprocess.Popen[bytes]:
    state = base / name
    state.mkdir(mode=0o700)
    endpoint = f"ipc://{state / 'broker.sock'}"
    env = dict(os.environ, CPQ_STATE_DIR=str(state), **MULTICAST_OFF)
    command = [sys.executable, "-m", "cpq.broker", "--endpoint", endpoint]
    command += ["--gpus", gpu, "--gpu-leases", str(leases), "--spares", "0"]
    log = open(base / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 60
    while not broker_alive(endpoint):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"broker {name} did not start; see {base / (name + '.log')}")
        time.sleep(0.1)
    return process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="0", help="the GPU index both brokers get")
    parser.add_argument("--hold", type=float, default=6.0, help="seconds A's task holds it")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    os.environ.update(MULTICAST_OFF)
    uuid = gpu_uuid(args.gpu)
    base = Path(tempfile.mkdtemp(prefix="cpq-lease-check-"))
    leases, records = base / "leases", base / "records.jsonl"
    records.touch()
    records.chmod(0o666)
    procs = {name: start_broker(name, base, args.gpu, leases) for name in ("A", "B")}
    pids = {name: p.pid for name, p in procs.items()}
    samples: list[tuple[float, list[str]]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            t = time.time()
            samples.append((t, [owner(pid, pids) for pid in apps_on(uuid)]))
            sampling.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results: dict[str, Any] = {}

    def run(name: str, hold: float) -> None:
        with Client(f"ipc://{base / name / 'broker.sock'}", name=f"lease-check-{name}") as c:
            kwargs = {"path": str(records), "tag": name, "hold_s": hold, "touch": True}
            results[name] = c.submit("workers.gpu_usage:record", 1, kwargs, timeout=300)

    try:
        first = threading.Thread(target=run, args=("A", args.hold))
        first.start()
        while not any('"tag": "A"' in line for line in records.read_text().splitlines()):
            if not first.is_alive():
                break
            time.sleep(0.05)
        second = threading.Thread(target=run, args=("B", 1.0))
        second.start()
        first.join()
        second.join()
        with Client(f"ipc://{base / 'B' / 'broker.sock'}") as c:
            b_pools = c.status()["pools"]
    finally:
        sampling.set()
        sampler.join()
        for process in procs.values():
            process.terminate()
        for process in procs.values():
            process.wait(30)
    rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    a_end = max((r["t"] for r in rows if r["tag"] == "A"), default=float("nan"))
    b_start = min((r["t"] for r in rows if r["tag"] == "B"), default=float("nan"))
    both = [t for t, owners in samples if "A" in owners and "B" in owners]
    crowded = [t for t, owners in samples if len(owners) > 1]  # also counts unknown owners
    b_spawn = b_pools[0]["ready_after_s"] if b_pools else None
    figures = {
        "gpu": uuid,
        "samples": len(samples),
        "overlap_seen": bool(both or crowded),
        "a_outcome": getattr(results.get("A"), "outcome", "none"),
        "b_outcome": getattr(results.get("B"), "outcome", "none"),
        "a_held_s": a_end - min((r["t"] for r in rows if r["tag"] == "A"), default=a_end),
        "yield_latency_s": b_start - a_end,
        "b_spawn_s": b_spawn,
        "a_leases_held": [r["leases_held"] for r in rows if r["tag"] == "A"][:1],
    }
    a_held = figures["a_held_s"]
    table = [
        ("overlap seen (both brokers' ranks on the GPU in one sample)", figures["overlap_seen"]),
        (
            "A's task (busy, never interrupted)",
            f"{figures['a_outcome']}, {a_held:.2f}s held",
        ),
        ("B's task", figures["b_outcome"]),
        ("yield latency: A's task end -> B's task start", f"{figures['yield_latency_s']:.2f}s"),
        ("  of which B's group spawn", f"{b_spawn:.2f}s" if b_spawn is not None else "-"),
        ("nvidia-smi samples (every 0.2 s)", len(samples)),
    ]
    width = max(len(k) for k, _ in table)
    for key, value in table:
        if isinstance(value, bool):
            value = "yes" if value else "no"
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"work directory: {base}")
    ok = not figures["overlap_seen"] and figures["a_outcome"] == figures["b_outcome"] == "passed"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
