"""Cost of the parity features (issue 19): import-time variable tracking, coverage in the
ranks, the caller's random state. Microbenchmarks in this process for the rank-side steps
(taken exactly where a rank takes them), and an end-to-end no-op task round trip through a
private broker with and without a coverage configuration.

    python tools/bench_parity.py [--tasks 300]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import PrivateBroker

from cpq import Client, rng
from cpq.rank import coverage_task, importenv


def per_call_us(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def import_us(reads: int, n: int = 200) -> float:
    """Median import time of a fresh module with ``reads`` variable reads, each from its own
    folder (a folder that fills up slows the finder down: that would not be this cost)."""
    source = "import os\n" + "".join(f"V{i} = os.environ.get('BENCH_V{i}')\n" for i in range(reads))
    times = []
    for i in range(n):
        folder = tempfile.mkdtemp()
        name = f"bench_mod_{reads}_{i}"
        (Path(folder) / f"{name}.py").write_text(source)
        sys.path.insert(0, folder)
        importlib.invalidate_caches()
        start = time.perf_counter()
        importlib.import_module(name)
        times.append(time.perf_counter() - start)
        sys.modules.pop(name)
        sys.path.remove(folder)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=300)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    sys.path.insert(0, str(folder))

    importenv.install()
    import numpy  # noqa: F401
    import torch.distributed  # noqa: F401  (what a rank imports at start)

    importenv.start_done()
    tracked, plain = type(os.environ), type(os.environ).__mro__[1]
    results: dict[str, list[float]] = {}
    for _ in range(3):  # alternate: the machine is shared
        for label, cls in (("plain", plain), ("tracked", tracked)):
            os.environ.__class__ = cls
            results.setdefault(f"{label} get", []).append(
                per_call_us(lambda: os.environ.get("HOME"), 100_000)
            )
            for k in (0, 20):
                results.setdefault(f"{label} import {k}", []).append(import_us(k, 100))
    os.environ.__class__ = tracked
    best = {key: min(values) for key, values in results.items()}
    plain_get, tracked_get = best["plain get"], best["tracked get"]
    plain_import = {k: best[f"plain import {k}"] for k in (0, 20)}
    tracked_import = {k: best[f"tracked import {k}"] for k in (0, 20)}
    bound = len(importenv.bound)
    differs = per_call_us(importenv.differs, 20_000)
    print(f"os.environ.get, not importing: {plain_get:.3f} us plain, {tracked_get:.3f} us tracked")
    for k in (0, 20):
        print(
            f"import of a module with {k} variable reads: {plain_import[k]:.0f} us plain, "
            f"{tracked_import[k]:.0f} us tracked"
        )
    print(f"per-task check of {bound} bound variables (importenv.differs): {differs:.2f} us")

    rng_state = rng.capture()
    snap = rng.Snapshot()
    print(
        f"rng: Snapshot.changed {per_call_us(snap.changed, 2000):.1f} us, capture "
        f"{per_call_us(rng.capture, 2000):.1f} us, install "
        f"{per_call_us(lambda: rng.install(rng_state), 2000):.1f} us"
    )

    config = {"config_file": "", "source": [str(folder)], "branch": False, "context": "t|run"}
    out: list[bytes] = []

    def measured() -> None:
        with coverage_task.measured(config, out):
            sum(range(10))

    print(
        f"coverage, rank side per task (start, body, stop, dumps, erase): "
        f"{per_call_us(measured, 200):.0f} us; first task (builds Coverage) once"
    )

    state = Path(tempfile.mkdtemp(prefix="bench-parity-"))
    broker = PrivateBroker(state / "state", state / "logs", "", dict(os.environ), ("--spares", "0"))
    try:
        with Client(broker.endpoint) as client:
            for label, cov in (("off", None), ("on", config), ("off", None), ("on", config)):
                client.submit("os:getpid", 2, coverage=cov)  # warm
                times = []
                for _ in range(args.tasks):
                    begin = time.perf_counter()
                    result = client.submit("os:getpid", 2, coverage=cov)
                    times.append(time.perf_counter() - begin)
                    assert result.outcome == "passed", result
                print(
                    f"no-op task round trip, ws=2, coverage {label}: median "
                    f"{statistics.median(times) * 1e3:.2f} ms over {args.tasks}"
                )
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
