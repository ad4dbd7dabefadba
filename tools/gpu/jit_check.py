"""GPU check: kernels compiled by torch.compile (TorchInductor + Triton) inside tasks keep
their groups warm (docs/design.md, "Fidelity: code"; generated code in compiler caches is
not the user's code).

On the H200 pair the rank's code check once stopped every group that compiled a kernel:
Triton's ``~/.triton/cache/.../cuda_utils*.so`` and Inductor's
``/tmp/torchinductor_<user>/.../<hash>.py`` are written during the task that first needs
them, and rewritten by a second group compiling the same kernel. This script runs
``--tasks`` compiled kernels of growing shapes on two ws=1 groups at once (two GPUs, or
one GPU shared with ``--oversubscribe``), with
empty caches, and checks that no group was stopped for "code changed". It also reports what
a rank sees of its home and caches, to explain a difference between hosts.

Usage (repo root, GPU host, pyzmq importable): ``python3 tools/gpu/jit_check.py [--tasks 6]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def compiled(n: int) -> dict[str, Any]:
    """A task: compile and run a small kernel of size ``n`` on this rank's GPU."""
    import torch

    from cpq.rank.freshness import cache_dirs

    @torch.compile
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + x

    x = torch.arange(n, device="cuda", dtype=torch.float32)
    value = float(f(x).sum().item())
    return {
        "value": value,
        "pid": os.getpid(),
        "HOME": os.environ.get("HOME"),
        "expanduser": os.path.expanduser("~"),
        "cache_dirs": cache_dirs(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
    from benchkit import PrivateBroker, child_env

    from cpq import Client

    for cache in (Path.home() / ".triton", Path(tempfile.gettempdir()) / "torchinductor_root"):
        shutil.rmtree(cache, ignore_errors=True)  # compile afresh, as on a new machine
    work = Path(tempfile.mkdtemp(prefix="cpq-jit-"))
    env = child_env(repo_first=False)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, str(ROOT / "tools" / "gpu")]))
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    import torch

    count = torch.cuda.device_count()
    gpus = ",".join(str(i) for i in range(count))
    extra = ("--spares", "0") + (("--oversubscribe",) if count < 2 else ())  # two groups
    broker = PrivateBroker(work / "state", work / "logs", gpus, env, extra)
    started = time.perf_counter()
    try:
        with Client(broker.endpoint, name="jit-check") as client:
            futures = [
                client.submit_async("jit_check:compiled", 1, {"n": 64 * (i + 1)}, timeout=300)
                for i in range(args.tasks)
            ]
            results = [f.result() for f in futures]
            totals = client.status()["totals"]
    finally:
        broker.stop()
    log = (work / "logs" / "broker.log").read_text(errors="replace")
    changed = [line for line in log.splitlines() if "code changed" in line]
    report = {
        "outcomes": [r.outcome for r in results],
        "groups": [r.group_id for r in results],
        "groups_started": totals["groups_started"],
        "code_changed": changed,
        "rank_view": results[0].ranks[0].value if results[0].ranks else None,
        "errors": [r.ranks[0].error.message for r in results if r.ranks and r.ranks[0].error],
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ok = set(report["outcomes"]) == {"passed"} and not changed
    print("jit check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
