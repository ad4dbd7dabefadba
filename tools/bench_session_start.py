"""Benchmark: how long the first test of a pytest session waits for its group.

Issue 15's session-start item: the first test of a session should wait for no spawn when
the broker already has its group, or can start it while pytest collects. Sessions of a
small project (a helper module, five ``@pytest.mark.cpq(world_size=2)`` tests that import
it; ws=2 gloo), each on a private broker, the wait read from the broker's timing history
(``queue_s`` of the session's first task):

* ``cold``: a fresh broker, no pytest cache: the plugin can warm only after collection;
* ``cold, cached``: a fresh broker, the project's pytest cache from an earlier session:
  the plugin asks for the group before collection starts (the cache-based warm-up);
* ``warm``: the next session on the same broker, nothing changed;
* ``edited``: the helper module is edited, then the next session (``--spares 1``, the
  default: the group that loaded the old helper refuses the task; the clean spare takes
  it), and the same with ``--spares 0``.

Collecting the project takes ``--collect-s`` seconds (default 2: two test modules whose
imports take half each, as a suite importing torch and its helpers does); a spawn here
takes ~5 s. Without a cache the plugin asks for the group when the first cpq test is
collected (after the first module's import), with one before collection starts.

Usage: ``python tools/bench_session_start.py [--reps 3] [--json tools/results/...]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

from cpq.timings import TIMINGS_FILE  # noqa: E402

TESTS = """
import time

import pytest

from helper import value

time.sleep({collect_s})  # what importing a real suite's modules costs


@pytest.mark.cpq(world_size=2)
@pytest.mark.parametrize("i", range(5))
def test_value(i):
    assert value() >= 0
"""
OTHER_TESTS = """
import time

time.sleep({collect_s})  # a second module, collected after the first


def test_local():
    pass
"""


def first_wait(broker: PrivateBroker, seen: int) -> tuple[float, int]:
    """``(queue_s of the first task after the first `seen` records, records now)``."""
    rows = [json.loads(line) for line in (broker.state / TIMINGS_FILE).read_text().splitlines()]
    return rows[seen]["queue_s"], len(rows)


def session(broker: PrivateBroker, project: Path, log: Path, cache: bool) -> float:
    env = dict(broker.env, CPQ_AUTOSTART="0", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "cpq.client.plugin"]
    if not cache:
        command += ["-p", "no:cacheprovider"]
    run = run_logged(command, log, env, project, 300)
    if run.rc != 0:
        raise SystemExit(f"session failed (rc {run.rc}); see {log}")
    return run.wall_s


def edit(project: Path, value: int) -> None:
    (project / "helper.py").write_text(f"def value():\n    return {value}\n")
    stamp = time.time() - 1.0  # saved a second ago, as by an editor
    os.utime(project / "helper.py", (stamp, stamp))


def one_rep(work: Path, rep: int, env: dict[str, str], collect_s: float) -> dict[str, float]:
    project = work / f"proj{rep}"
    project.mkdir()
    # Two modules, each taking half the collection time to import: the first holds the
    # cpq tests (pytest runs them first), the second is collected after it.
    (project / "test_a.py").write_text(textwrap.dedent(TESTS.format(collect_s=collect_s / 2)))
    (project / "test_b.py").write_text(OTHER_TESTS.format(collect_s=collect_s / 2))
    edit(project, 1)
    waits: dict[str, float] = {}
    log = work / f"rep{rep}.log"
    for spares in ("1", "0"):
        # cold (no cache), then cold with the cache the first session wrote
        for label, cache in (("cold", False), ("cold, cached", True)):
            if spares == "0" and label == "cold":
                continue
            if label == "cold, cached" and spares == "1":
                # one session writes the cache, on a throw-away broker
                b = PrivateBroker(work / f"c{rep}", work / f"cl{rep}", "none", env)
                try:
                    session(b, project, log, cache=True)
                finally:
                    b.stop()
            state = work / f"s{rep}-{spares}-{label[:4]}{int(cache)}"
            broker = PrivateBroker(state, work / f"l{rep}", "none", env, ("--spares", spares))
            try:
                session(broker, project, log, cache)
                wait, seen = first_wait(broker, 0)
                if label == "cold, cached":
                    if spares == "1":
                        waits["cold, cached"] = wait
                    session(broker, project, log, cache)
                    wait, seen = first_wait(broker, seen)
                    waits[f"warm (spares {spares})"] = wait
                    # let the pool come to rest (the spare ready), as between two edits
                    while any(p["state"] == "starting" for p in broker.status()["pools"]):
                        time.sleep(0.2)
                    edit(project, 2 + rep)
                    session(broker, project, log, cache)
                    waits[f"edited (spares {spares})"], seen = first_wait(broker, seen)
                else:
                    waits["cold"] = wait
            finally:
                broker.stop()
                shutil.rmtree(state, ignore_errors=True)
    return waits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--collect-s", type=float, default=2.0)
    parser.add_argument(
        "--json", type=Path, default=ROOT / "tools" / "results" / "bench_session_start.json"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cpqss-"))  # short: ipc paths have a length limit
    env = child_env()
    reps = [one_rep(work, rep, env, args.collect_s) for rep in range(args.reps)]
    medians = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, {cpu_model()}, no GPU",
        "load_average_at_start": os.getloadavg()[0],
        "command": f"python tools/bench_session_start.py --reps {args.reps}",
        "collect_s": args.collect_s,
        "first_test_wait_s": {"median": medians, "runs": reps},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nfirst test's wait for its group ({args.reps} runs, collection {args.collect_s} s)")
    for key, value in medians.items():
        runs = ", ".join(f"{r[key]:.2f}" for r in reps)
        print(f"  {key:22s} {value:6.2f} s   ({runs})")
    print(f"\nwritten to {args.json}; logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
