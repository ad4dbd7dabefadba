"""Warm ``--cpq-world-size`` sessions with and without the warm caller (cpq/caller), with the
fresh ``torchrun -m pytest`` run beside them; alternated, in one run.

The project's conftest imports torch and a package of its own whose import costs
``--import-s`` seconds of CPU, standing in for a suite whose conftest imports the world
(Megatron-LM's). One broker (private state directory), warmed by a first session, which
also starts the project's warm caller (``CPQ_WARM_CALLER=1``); then each repetition runs a
session with ``CPQ_WARM_CALLER=0`` (the pytest process imports everything itself), one
handed to the warm caller, one that comes right after the session that started the
project's first warm caller (Megatron-LM's run.sh: it waits for the warm caller still
warming), and the fresh run, each once the machine's CPUs are quiet.
Printed: walls, medians, and whether every session's verdicts were the fresh run's.

    python tools/bench_warm_caller.py [--reps 3] [--tests 50] [--import-s 2.0] [--json OUT]
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
import xml.etree.ElementTree as ET
from pathlib import Path

from bench_cold import fresh_session
from bench_opening import CONFTEST, SLOW_PACKAGE, TESTS
from bench_pytest_ranks import ROOT, quiet_cpu, start_broker, tree_env

sys.path.insert(0, str(ROOT))
from cpq.caller import wire


def verdicts(xml: Path) -> dict[str, str]:
    found = {}
    for case in ET.parse(xml).iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        found[case.get("name", "")] = kinds[0] if kinds else "passed"
    return found


def session(project: Path, env: dict[str, str], warm: str, xml: Path, settle: bool = True) -> float:
    if settle:  # not right after another session: its warm caller busies the CPU
        quiet_cpu()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "cpq.client.plugin"]
    command += ["--cpq-world-size", "1", f"--junitxml={xml}", "tests"]
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=project, env={**env, "CPQ_WARM_CALLER": warm}, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"session failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    return wall


def fresh(project: Path, env: dict[str, str], xml: Path) -> float:
    return fresh_session(project, env, f"--junitxml={xml}")


def served(state: Path) -> int:
    logs = "".join(p.read_text() for p in (state / "callers").glob("*.log"))
    return len(re.findall(r"session \d+ started: ", logs))


def wait_for_warm_caller(state: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        for path in (state / "callers").glob("*.sock"):
            probe = wire.connect(path, 1.0)
            if probe is not None:
                probe.close()
                return
        time.sleep(0.2)  # the socket appears when the warm caller has imported its plan
    raise SystemExit("no warm caller came up")


def forget_warm_callers(state: Path) -> None:
    """No warm caller, and nothing a former one learnt: as a project's first session."""
    subprocess.run(["pkill", "-f", f"cpq.caller {state}"], check=False)
    for path in (state / "callers").glob("*"):
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tests", type=int, default=50)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--import-s", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    # Short: the warm caller's socket lives under the state directory (108 bytes at most).
    work = Path(tempfile.mkdtemp(prefix="bwc-"))
    project = work / "project"
    (project / "tests").mkdir(parents=True)
    (project / "slowpkg").mkdir()
    (project / "slowpkg" / "__init__.py").write_text(SLOW_PACKAGE.format(seconds=args.import_s))
    (project / "tests" / "conftest.py").write_text(CONFTEST.format(slow="import slowpkg\n"))
    (project / "tests" / "test_many.py").write_text(TESTS.format(n=args.tests, slow=""))
    (project / "pytest.ini").write_text("[pytest]\n")
    state = work / "s"
    env = tree_env(ROOT, state)
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{project}"
    broker = start_broker(env, "none", work / "broker.log")
    walls: dict[str, list[float]] = {"off": [], "warm caller": [], "right after": [], "fresh": []}
    same = True
    handed_after = 0
    try:
        session(project, env, "1", work / "prime.xml")  # the group, and the warm caller
        wait_for_warm_caller(state)
        fresh(project, env, work / "fresh.xml")
        reference = verdicts(work / "fresh.xml")
        for rep in range(args.reps):
            walls["off"].append(session(project, env, "0", work / f"off-{rep}.xml"))
            before = served(state)
            walls["warm caller"].append(session(project, env, "1", work / f"on-{rep}.xml"))
            if served(state) != before + 1:
                raise SystemExit("the session was not handed to the warm caller")
            # Megatron's run.sh: a session, and the next one at once, while the warm caller
            # the first started is still warming: the second waits for it.
            forget_warm_callers(state)
            session(project, env, "1", work / f"first-{rep}.xml")
            before = served(state)
            walls["right after"].append(
                session(project, env, "1", work / f"after-{rep}.xml", settle=False)
            )
            handed_after += served(state) - before
            walls["fresh"].append(fresh(project, env, work / f"fresh-{rep}.xml"))
            for name in (f"off-{rep}", f"on-{rep}", f"after-{rep}"):
                same = same and verdicts(work / f"{name}.xml") == reference
    finally:
        broker.terminate()
        broker.wait(timeout=60)
        subprocess.run(["pkill", "-f", f"cpq.caller {state}"], check=False)
    print(
        f"{args.tests} tests, --cpq-world-size 1, warm broker, the conftest imports torch and "
        f"{args.import_s} s of CPU; {args.reps} repetitions, alternated"
    )
    print("| run | wall, median (s) | walls (s) |")
    print("| --- | --- | --- |")
    labels = {
        "fresh": "fresh torchrun -m pytest",
        "off": "CPQ_WARM_CALLER=0",
        "warm caller": "handed to the warm caller",
        "right after": "right after the session that started it (waits for it)",
    }
    for name in ("fresh", "off", "warm caller", "right after"):
        listed = ", ".join(f"{v:.2f}" for v in walls[name])
        print(f"| {labels[name]} | {statistics.median(walls[name]):.2f} | {listed} |")
    print(f"right after: {handed_after} of {args.reps} handed over")
    print(f"every verdict the fresh run's: {same}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "walls": walls,
                    "same": same,
                    "right_after_handed_over": handed_after,
                }
            )
        )


if __name__ == "__main__":
    main()
