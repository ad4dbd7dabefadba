"""Where a no-op round trip's time goes, step by step, in the client, the broker and each rank.

Why this exists (issue 34's round trip): profilers mislead on this path (see
:mod:`cpq.tracepoints`), and ``tools/bench_core.py`` splits it into four coarse parts only.
This starts a private broker with ``CPQ_TRACE_DIR`` set (and passed to the ranks as a start
variable), runs ``--tasks`` no-ops one at a time on a ws=2 gloo group, and prints the median
and p90 of each step between two notes, the slowest rank's where both ranks note it:

    client builds the submit | to the broker | broker: submit to dispatch | to the ranks |
    rank: boundary and code check | rank: the task | rank: its report | to the broker |
    broker: reports to verdict | to the client, decoded | client returns

The "to ..." steps are a hop (the sender's send call, libzmq's I/O threads on both ends, the
receiver's wake-up) plus the receiver's decoding of the frame: every note of a send is taken
before it, since the receiver may run first on a busy machine. Run it in two checkouts,
alternated, to compare code.

Usage: ``python tools/trace_dispatch.py [--tasks 1000] [--json out.json]``
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "tools"))

from benchkit import cpu_broker  # noqa: E402

from cpq import Client, tracepoints  # noqa: E402

NOOP = "workers.collectives:noop"
#: (step name, from note, to note); "*": the latest of the ranks' notes of that name.
STEPS = [
    ("client builds the submit", "client submits", "client sends"),
    ("to the broker", "client sends", "broker reads the submit"),
    ("broker: submit to dispatch", "broker reads the submit", "broker dispatches"),
    ("to the ranks (the later)", "broker dispatches", "*rank has the task"),
    ("rank: boundary and code check", "rank has the task", "rank checked"),
    ("rank: the task (reset, capture, call)", "rank checked", "rank ran it"),
    ("rank: its report", "rank ran it", "rank sends its report"),
    ("to the broker (the later report)", "*rank sends its report", "*broker reads a report"),
    ("broker: reports to verdict", "*broker reads a report", "broker sends the verdict"),
    ("to the client, decoded", "broker sends the verdict", "client decoded the verdict"),
    ("client returns", "client decoded the verdict", "client returns"),
    ("round trip", "client submits", "client returns"),
]


def read_notes(folder: str) -> dict[str, dict[str, list[float]]]:
    notes: dict[str, dict[str, list[float]]] = {}
    for path in glob.glob(os.path.join(folder, "*.jsonl")):
        with open(path) as handle:
            for line in handle:
                for task_id, step, at in json.loads(line):
                    notes.setdefault(task_id, {}).setdefault(step, []).append(at)
    return notes


def step_times(notes: dict[str, list[float]]) -> dict[str, float] | None:
    """Each step's seconds for one task; None when a note is missing (a rank's last 200)."""
    out = {}
    for name, start, end in STEPS:
        if start.startswith("*") or end.startswith("*"):
            a, b = notes.get(start.lstrip("*")), notes.get(end.lstrip("*"))
            if not a or not b:
                return None
            out[name] = max(b) - max(a)
        elif start.startswith("rank"):  # per rank: the slower one
            a, b = sorted(notes.get(start, [])), sorted(notes.get(end, []))
            if len(a) != 2 or len(b) != 2:
                return None
            # paired by time, not by process: the slower rank's step, near enough
            out[name] = max(y - x for x, y in zip(a, b, strict=True))
        else:
            if start not in notes or end not in notes:
                return None
            out[name] = notes[end][0] - notes[start][0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--json", help="also write the medians here")
    args = parser.parse_args()
    trace = tempfile.mkdtemp(prefix="cpq-trace-")
    # This process notes too (its module read the variable at import: set it here), and
    # the ranks see it as a start variable of the spec.
    os.environ.update(CPQ_TRACE_DIR=trace, CPQ_SPEC_ENV="CPQ_TRACE_DIR")
    tracepoints.DIR = trace
    with cpu_broker("cpq-trace-state-") as (endpoint, _):
        with Client(endpoint, name="trace_dispatch") as client:
            first = client.submit(NOOP, 2, roots=[str(ROOT)]).task_id  # the group's start
            while any(p["state"] == "starting" for p in client.status()["pools"]):
                time.sleep(0.1)
            warm = [client.submit(NOOP, 2, roots=[str(ROOT)]).task_id for _ in range(50)]
            for _ in range(args.tasks):
                assert client.submit(NOOP, 2, roots=[str(ROOT)]).outcome == "passed"
        tracepoints.flush()
    notes = read_notes(trace)
    shutil.rmtree(trace, ignore_errors=True)
    left_out = {first, *warm}
    times = [t for task_id, n in notes.items() if task_id not in left_out and (t := step_times(n))]
    medians = {name: statistics.median(t[name] for t in times) * 1e6 for name, _, _ in STEPS}
    print(f"{os.cpu_count()} cores, {len(times)} of {args.tasks} no-ops with every note (µs):")
    for name, _, _ in STEPS:
        ordered = sorted(t[name] for t in times)
        p90 = ordered[int(0.9 * len(ordered))] * 1e6
        print(f"  {name:40} p50 {medians[name]:8.1f}   p90 {p90:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tasks": len(times), "p50_us": medians}))


if __name__ == "__main__":
    main()
