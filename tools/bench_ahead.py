"""Warm launches with the ranks importing ahead (cpq/rank/ahead.py) against the same broker
code with it off (``CPQ_IMPORT_AHEAD=0``), side by side in one run, alternated.

Each launch is ``cpq torchrun --standalone --nproc-per-node N SCRIPT`` from a shell; the
script imports a library that a fresh process imports anew (accelerate and its
``PartialState``, by default) and a helper module beside it, and prints how long its imports
took (``IMPORT_S``). Two private brokers, one per setting, each warmed by one launch; then
``--launches`` per broker, alternated, each started once the CPUs are quiet (an idle rank
importing ahead is work no broker sees). Printed: the median launch wall and the median of
the slowest rank's import time, per setting.

    python tools/bench_ahead.py [--launches 8] [--nproc 2] [--back-to-back] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pytest_ranks import quiet_cpu
from benchkit import PrivateBroker, child_env

SCRIPT = """
import time
started = time.perf_counter()
import helper
from accelerate import PartialState
state = PartialState()
helper.CALLS.append(state.process_index)
assert len(helper.CALLS) == 1, "a helper module's state from an earlier launch"
print(f"IMPORT_S {time.perf_counter() - started:.4f}", flush=True)
"""

HELPER = """
CALLS = []
"""


def launch(broker: PrivateBroker, work: Path, nproc: int, quiet: bool) -> tuple[float, float]:
    """One warm launch: (its wall, the slowest rank's import time)."""
    if quiet:
        quiet_cpu()
    command = [sys.executable, "-m", "cpq", "torchrun", "--standalone"]
    command += ["--nproc-per-node", str(nproc), "script.py"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=work, env=broker.env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the launch failed:\n{done.stdout}\n{done.stderr}")
    imports = [float(x) for x in re.findall(r"IMPORT_S ([0-9.]+)", done.stdout)]
    return wall, max(imports)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--back-to-back",
        action="store_true",
        help="each broker's launches one right after the other (no wait for quiet CPUs: "
        "a launch then waits for the rank still importing ahead)",
    )
    options = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="cpq-bench-ahead-"))
    work = base / "work"
    work.mkdir()
    (work / "script.py").write_text(SCRIPT)
    (work / "helper.py").write_text(HELPER)
    settings = {"imports ahead": "1", "off (CPQ_IMPORT_AHEAD=0)": "0"}
    brokers = {
        name: PrivateBroker(
            base / f"state-{value}",
            base / f"logs-{value}",
            "none",
            dict(child_env(), CPQ_IMPORT_AHEAD=value),
            ("--spares", "0"),
        )
        for name, value in settings.items()
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    try:
        for broker in brokers.values():
            launch(broker, work, options.nproc, True)  # cold: the group starts
        if options.back_to_back:
            for name, broker in brokers.items():
                quiet_cpu()
                for _ in range(options.launches):
                    runs[name].append(launch(broker, work, options.nproc, False))
        else:
            for _ in range(options.launches):
                for name, broker in brokers.items():
                    runs[name].append(launch(broker, work, options.nproc, True))
    finally:
        for broker in brokers.values():
            broker.stop()
    how = "back to back" if options.back_to_back else "alternated, on quiet CPUs"
    print(f"{options.launches} warm launches each, nproc {options.nproc}, {how}")
    print("| setting | launch wall, median (s) | the script's imports, median (s) | walls (s) |")
    print("| --- | --- | --- | --- |")
    for name, got in runs.items():
        walls = [w for w, _ in got]
        imports = [i for _, i in got]
        print(
            f"| {name} | {statistics.median(walls):.2f} | {statistics.median(imports):.3f} | "
            + ", ".join(f"{w:.2f}" for w in walls)
            + " |"
        )
    if options.json:
        options.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
