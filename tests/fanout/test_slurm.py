"""CI fan-out on a real two-node Slurm cluster, through the shipped templates, unmodified.

``tools/ci/slurm/submit.sh`` submits ``cpq-shards.sbatch`` (an array, one shard per node)
and ``cpq-merge.sbatch`` (the verdict, after the array) exactly as a user would; each shard
autostarts its node's own broker (state under the job's ``TMPDIR``). The jobs get a clean
environment: nothing of this session's broker (``CPQ_ENDPOINT``, ``CPQ_STATE_DIR``) or of
pytest reaches them, and no durations path or run id is set by hand: the templates' own
defaults are what is tested. ``submit.sh --wait`` is run as a CI step would run it: its exit
status and what it prints are the verdict.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from .slurm import SlurmCluster, wait_until

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "tools" / "ci" / "slurm"
PYTEST_ARGS = ("-p", "cpq.client.plugin", "-p", "no:cacheprovider", "-q", "test_suite.py")

#: The closing figure's suite: tests of 2 s, 1 s and 0.2 s on warm ws=1 groups.
BALANCE_SUITE = """
import os
import time

import pytest

SECONDS = [2.0, 2.0, 1.0, 1.0, 1.0] + [0.2] * 10


@pytest.mark.cpq(world_size=1)
@pytest.mark.parametrize("n", range(len(SECONDS)))
def test_work(n):
    import torch.distributed as dist

    time.sleep(SECONDS[n])
    assert dist.get_world_size() == 1


@pytest.mark.parametrize("n", range(4))
def test_local(n):
    assert not (n == 3 and os.path.exists("broken")), "the suite is broken"
"""
BALANCE_SECONDS = [2.0, 2.0, 1.0, 1.0, 1.0] + [0.2] * 10

#: Two pool specs (same world size, another marker env) that the durations below keep on
#: separate shards: spec "a" on shard 0, spec "b" on shard 1.
SPLIT_SUITE = """
import time

import pytest


@pytest.mark.cpq(world_size=1)
@pytest.mark.parametrize("n", range(6))
def test_a(n):
    time.sleep(0.4)


@pytest.mark.cpq(world_size=1, env={"FLAVOUR": "b"})
@pytest.mark.parametrize("n", range(6))
def test_b(n):
    time.sleep(0.4)


@pytest.mark.cpq(world_size=2)
def test_wide():
    pass
"""
SPLIT_DURATIONS = {
    **{f"test_suite.py::test_a[{n}]": 0.4 for n in range(6)},
    **{f"test_suite.py::test_b[{n}]": 0.4 for n in range(6)},
    "cpq:spawn:ws1": 4.0,
    "cpq:spawn:ws1 FLAVOUR=b": 4.0,
}


def make_project(tmp_path_factory: pytest.TempPathFactory, suite: str) -> Path:
    path = Path(tmp_path_factory.mktemp("fanout", numbered=True))
    path.chmod(0o755)
    (path / "test_suite.py").write_text(suite)
    return path


def job_env(cluster: SlurmCluster, project: Path, **extra: str) -> dict[str, str]:
    return {
        "PYTHONPATH": str(ROOT),
        "CPQ_PYTHON": sys.executable,
        "CPQ_RESULTS": str(project / "results"),
        "TMPDIR": str(cluster.dir),  # node-local state: under the cluster, found at teardown
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        **extra,
    }


def ids(out: str) -> tuple[str, str, str]:
    """(run id, array job, merge job) from what submit.sh printed."""
    words = out.split()
    run, array, merge = (words[words.index(key) + 1] for key in ("run:", "shards:", "merge:"))
    return run, array, merge


def submit(
    cluster: SlurmCluster, project: Path, *args: str, umask: int = -1, **env: str
) -> tuple[str, str, str]:
    """``submit.sh ARGS pytest-args`` from the project directory: (run id, array, merge)."""
    out = cluster.run(
        str(SLURM / "submit.sh"), *args, *PYTEST_ARGS, env=job_env(cluster, project, **env),
        cwd=project, umask=umask,
    )  # fmt: skip
    return ids(out)


def submit_waiting(
    cluster: SlurmCluster, project: Path, *args: str, umask: int = -1, **env: str
) -> subprocess.Popen[str]:
    """``submit.sh --wait ARGS pytest-args`` started, as a CI step runs it (without the
    option when ``SBATCH_WAIT`` is in ``env``: that variable asks for the wait)."""
    flag = [] if "SBATCH_WAIT" in env else ["--wait"]
    return subprocess.Popen(
        [str(SLURM / "submit.sh"), *flag, *args, *PYTEST_ARGS],
        env={**cluster.env, **job_env(cluster, project, **env)},  # --wait's own polling
        cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, umask=umask,
    )  # fmt: skip


def finished(step: subprocess.Popen[str], first: str = "") -> tuple[int, str]:
    """The exit status and the whole output of a ``submit.sh --wait`` step."""
    out, _ = step.communicate(timeout=180)
    return step.returncode, first + out


def wait_done(cluster: SlurmCluster, job: str, within: float = 120) -> None:
    wait_until(f"end of job {job}", lambda: not cluster.queue(job), within=within, every=0.25)


def run_logs(project: Path, run: str) -> Path:
    return project / "results" / "logs" / run


def verdict(cluster: SlurmCluster, project: Path, run: str, merge_job: str) -> tuple[int, str]:
    """The merge job's exit status (as it left it in the run's logs) and output."""
    wait_done(cluster, merge_job)
    logs = run_logs(project, run)
    status = (logs / f"cpq-merge-{merge_job}.status").read_text()
    return int(status), (logs / f"cpq-merge-{merge_job}.out").read_text()


def merge_here(results: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cpq", "merge", *args, str(results)],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def manifest(project: Path, index: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (project / "results" / f"shard-{index}-of-2.json").read_text()
    )
    return data


def outputs(project: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(project.rglob("*.out")))


def modes(*roots: Path) -> dict[str, str]:
    """Permission bits of every file and directory under ``roots``, by kind."""
    found: dict[str, set[str]] = {"file": set(), "dir": set()}
    for root in roots:
        for path in [root, *root.rglob("*")] if root.is_dir() else [root]:
            found["dir" if path.is_dir() else "file"].add(oct(path.stat().st_mode & 0o777))
    return {kind: ",".join(sorted(bits)) for kind, bits in found.items()}


def test_wait_gives_the_verdict_and_a_fixed_suite_teaches_the_next_run_to_balance(
    slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    project = make_project(tmp_path_factory, BALANCE_SUITE)
    results = project / "results"
    (project / "broken").touch()  # one test fails while it is there
    status, out = finished(submit_waiting(slurm, project, "2", umask=0o027))
    run1 = ids(out)[0]
    print(f"submit.sh --wait, one test failing: exit {status}\n{out}")
    assert status == 1, out + outputs(project)
    assert "verdict: every collected test ran exactly once; 1 failed (exit 1)" in out, out
    assert f"run {run1}: exit 1; JUnit: {results / 'junit.xml'}" in out, out
    assert ET.parse(results / "junit.xml").getroot().get("name") == f"cpq run {run1}"
    learned = json.loads((project / ".cpq" / "durations.json").read_text())  # shards' default
    for n, seconds in enumerate(BALANCE_SECONDS):  # the measured spawn wait is not a test's
        # (a group's first task also imports the test module and pytest on the rank: < 1 s)
        assert seconds <= learned[f"test_suite.py::test_work[{n}]"] < seconds + 1.0, learned
    assert learned["cpq:spawn:ws1"] > 0
    logs = run_logs(project, run1)
    assert len(list(logs.glob("shard-*/group-*-agent.log"))) >= 2  # kept
    assert sorted(p.name for p in logs.glob("*.out"))[-1].startswith("cpq-shard-"), "job output"
    assert not list(project.glob("*.out"))  # none in the checkout
    # A teammate (the group) can read every file of the run, as the umask says: 027.
    assert modes(results, project / ".cpq") == {"file": "0o640", "dir": "0o750"}

    (project / "broken").unlink()
    status, out = finished(submit_waiting(slurm, project, "2"))
    run2 = ids(out)[0]
    assert status == 0, out + outputs(project)
    assert "every collected test ran exactly once and passed (exit 0)" in out, out
    assert run2 != run1 and {manifest(project, i)["run_id"] for i in (0, 1)} == {run2}
    walls = [float(manifest(project, i)["wall_s"]) for i in (0, 1)]
    print(f"second run's shard walls: {walls}, max/min {max(walls) / min(walls):.2f}")
    assert max(walls) / min(walls) <= 1.25, (walls, out)


def test_stale_cancelled_and_rerun_shards_never_make_a_false_green(
    slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    project = make_project(tmp_path_factory, SPLIT_SUITE)
    (project / ".cpq").mkdir()
    (project / ".cpq" / "durations.json").write_text(json.dumps(SPLIT_DURATIONS))
    ks = ("-k", "not wide")
    results = project / "results"

    # Run 1: each shard's collection starts only the group of the spec it keeps, and its
    # broker no spare (the shard's tests would never use one: nothing set by hand).
    run1, _, merge1 = submit(slurm, project, "2", *ks)
    status, out = verdict(slurm, project, run1, merge1)
    assert status == 0, out + outputs(project)
    for index, spec_test in enumerate(("test_a", "test_b")):
        kept = manifest(project, index)["selected"]
        assert kept and all(spec_test in t for t in kept), kept
        groups = list(run_logs(project, run1).glob(f"shard-{index}-of-2-*/group-*-agent.log"))
        assert len(groups) == 1, groups
    assert (results / "junit.xml").exists()

    # Run 2 into the same directory, waited for; shard 1 is cancelled before it starts, so
    # the file of shard 1 is still run 1's: never merged as run 2's, and run 1's JUnit goes.
    blocker = slurm.run(
        "sbatch", "--parsable", "--exclusive", "-w", "n2", f"--output={project}/block.log",
        "--wrap", "sleep 300", env={"PATH": "/usr/bin:/bin"},
    ).strip()  # fmt: skip
    wait_until("blocker running", lambda: slurm.queue(blocker) == [(blocker, "RUNNING")], 30)
    step = submit_waiting(slurm, project, "2", *ks)
    assert step.stdout is not None
    first = step.stdout.readline()  # submit.sh names the run and its jobs, then waits
    run2, array2, _ = ids(first)
    wait_until(
        "shard 0 running and shard 1 pending",
        lambda: sorted(s for _, s in slurm.queue(array2)) == ["PENDING", "RUNNING"],
        within=30,
        every=0.1,
    )
    slurm.run("scancel", f"{array2}_1")
    slurm.run("scancel", blocker)
    status, out = finished(step, first)
    stale = str(results / "shard-1-of-2.json")
    assert status == 2, out
    assert f"ignored (other runs): {stale}" in out and "no result from shard(s) 1/2" in out
    assert f"run {run2}: exit 2; no JUnit written" in out, out
    assert not (results / "junit.xml").exists()  # run 1's is not left to stand for run 2
    by_hand = merge_here(results)  # no --run-id: two runs in one directory
    assert by_hand.returncode == 2, by_hand.stdout
    assert f"1 shard result(s) of run {run2} (and 1 of other runs)" in by_hand.stdout
    assert f"run {run1}: {stale}" in by_hand.stdout, by_hand.stdout

    # Rerun shard 1 into run 2 (submit.sh --shard), cancelled midway: the merge lists
    # exactly the tests it did not run, and its row what it ran.
    resubmitted = time.time()
    _, rerun, merge3 = submit(slurm, project, "--shard", "1", "2", *ks)
    shard1 = results / "shard-1-of-2.json"

    def ran_some() -> bool:  # two tests in the manifest, one in the timeline (a loaded CI)
        try:
            data = json.loads(shard1.read_text())
            lines = (results / "shard-1-of-2.timeline.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return False
        tasks = [r for r in map(json.loads, filter(None, lines)) if r.get("ev") == "task"]
        timed = any(float(r.get("t", 0)) >= resubmitted for r in tasks)
        return data.get("run_id") == run2 and len(data.get("tests", {})) >= 2 and timed

    def ran_all(restart: int) -> bool:  # the file is gone for a moment when a shard starts
        try:
            data = json.loads(shard1.read_text())
        except FileNotFoundError:
            return False
        return data.get("restart_count") == restart and data.get("complete") is True

    wait_until("two tests of the rerun on disk", ran_some, within=90, every=0.1)
    slurm.run("scancel", rerun)
    status, out = verdict(slurm, project, run2, merge3)
    assert status == 2, out
    data = manifest(project, 1)
    ran, owed = data["tests"], [t for t in data["selected"] if t not in data["tests"]]
    assert 0 < len(owed) < 6 and f"MISSING ({len(owed)}): {', '.join(owed)}" in out, out
    assert float(data["wall_s"]) >= 0.4 * len(ran) and data["spawns"] == 1, data
    row = re.search(rf"^  1/2 +n\S+ +{len(ran)}/6 +0 +([0-9.]+) +1 .*UNFINISHED$", out, re.M)
    assert row and float(row.group(1)) > 0, out
    wait_done(slurm, rerun)
    assert slurm.state(rerun) == "CANCELLED"

    # The cancelled rerun, requeued, completes the run and keeps its first log; the lost
    # attempt stays in the summary and the timeline.
    slurm.run("scontrol", "requeue", rerun)
    slurm.run("scontrol", "update", f"jobid={rerun}", "StartTime=now")
    wait_until("the requeued shard's result", lambda: ran_all(restart=1), 120)
    wait_done(slurm, rerun)
    html = project / "timeline.html"
    final = merge_here(results, "--run-id", run2, "--timeline", str(html))
    assert final.returncode == 0, final.stdout + final.stderr + outputs(project)
    (lost,) = manifest(project, 1)["attempts"]
    assert (lost["restart_count"], lost["complete"], lost["tests"]) == (0, False, len(ran))
    assert re.search(rf"^   attempt 0 +n\S+ +{len(ran)} .* 0 +lost$", final.stdout, re.M), (
        final.stdout
    )
    records = (results / lost["timeline"]).read_text().splitlines()
    assert sum('"ev": "task"' in r or '"ev":"task"' in r for r in records) >= 1, records
    assert "attempt 0 (lost)" in html.read_text()
    log = (run_logs(project, run2) / f"cpq-shard-{rerun}_1.out").read_text()
    assert "(job " in log and "restart 0)" in log and "restart 1)" in log, log
    assert len(list(run_logs(project, run2).glob(f"shard-1-of-2-job{rerun}-restart*"))) == 2


def test_cluster_and_broker_options_pass_through_and_a_merge_without_cpq_is_exit_3(
    slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    project = make_project(tmp_path_factory, SPLIT_SUITE)
    step = submit_waiting(
        slurm, project, "--partition=debug", "--time=5", "1", "-k", "wide",
        CPQ_BROKER_ARGS="--max-ranks 1", SBATCH_WAIT="1",  # sbatch's own variable: a wait
        CPQ_SHARD_SBATCH_ARGS="--comment=for-the-shards",
        CPQ_MERGE_SBATCH_ARGS="--job-name=cpq-merge-here",
    )  # fmt: skip
    status, out = finished(step)
    _, array, merge = ids(out)
    assert status == 1, out + outputs(project)
    assert "exceeds this broker's --max-ranks 1" in manifest_text(project)
    for job, wanted in ((array, "Comment=for-the-shards"), (merge, "JobName=cpq-merge-here")):
        shown = slurm.run("scontrol", "-o", "show", "job", job)
        assert "Partition=debug" in shown and "TimeLimit=00:05:00" in shown, shown
        assert wanted in shown, shown
    env = job_env(slurm, project, CPQ_PYTHON="/usr/bin/python3", PYTHONPATH="")
    job = slurm.run(
        "sbatch", "--parsable", str(SLURM / "cpq-merge.sbatch"), env=env, cwd=project
    ).strip()
    wait_done(slurm, job)
    assert slurm.exit_code(job) == 3
    assert (project / "results" / "logs" / f"cpq-merge-{job}.status").read_text() == "3\n"
    assert "cannot import cpq" in (project / f"cpq-merge-{job}.out").read_text()


def manifest_text(project: Path) -> str:
    return (project / "results" / "shard-0-of-1.json").read_text()


def test_shards_with_different_durations_are_detected(
    slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two shards that balanced on different durations files cannot both be trusted.

    Only the unmarked tests of the balance suite: no group is needed to show it."""
    project = make_project(tmp_path_factory, BALANCE_SUITE)
    other = {"test_suite.py::test_local[0]": 60.0, "test_suite.py::test_local[1]": 1.0}
    (project / "other.json").write_text(json.dumps(other))
    jobs = []
    # Results on each node's own disk (as a CI matrix uploads them): a shard cannot see the
    # partition input another shard of its run recorded, so nothing reconciles them.
    for shard, durations in (("0/2", "none.json"), ("1/2", "other.json")):
        env = job_env(slurm, project, CPQ_SHARD=shard, CPQ_RUN_ID="by-hand")
        env["CPQ_DURATIONS"] = str(project / durations)
        env["CPQ_RESULTS"] = str(project / f"results-{shard[0]}")
        jobs.append(
            slurm.run(
                "sbatch", "--parsable", "--array=0", str(SLURM / "cpq-shards.sbatch"),
                *PYTEST_ARGS, "-k", "test_local", env=env, cwd=project,
            ).strip().split(";")[0]
        )  # fmt: skip
    for job in jobs:
        wait_done(slurm, job)
    merged = merge_here(project / "results-0", str(project / "results-1"))
    assert merged.returncode == 2, merged.stdout + merged.stderr + outputs(project)
    assert "shards computed different selections" in merged.stdout
    assert "0/2" in merged.stdout and "1/2" in merged.stdout


#: Tests whose recorded seconds give another partition than equal counts do.
RERUN_SUITE = """
import os
import time

import pytest

SECONDS = [1.5, 1.0] + [0.1] * 6


@pytest.mark.parametrize("n", range(len(SECONDS)))
def test_t(n):
    time.sleep(SECONDS[n])
    assert not (n == 3 and os.path.exists("broken")), "broken"
"""


def selections(project: Path) -> list[list[str]]:
    return [list(manifest(project, i)["selected"]) for i in (0, 1)]


def test_a_shard_rerun_after_the_merge_gives_the_runs_verdict(
    slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The documented recovery: a run fails, its merge writes the next durations file, the
    failed shard is rerun with ``submit.sh --wait --shard`` (then by hand, with the run's id
    and ``--cpq-shard``): the shard keeps the share the run started with and the merge
    gives the run's verdict, never "incomplete"."""
    from cpq.fanout.shard import TestInfo, partition

    project = make_project(tmp_path_factory, RERUN_SUITE)
    results = project / "results"
    (project / "broken").touch()
    status, out = finished(submit_waiting(slurm, project, "2"))
    run = ids(out)[0]
    assert status == 1, out + outputs(project)
    first = selections(project)
    learned = json.loads((project / ".cpq" / "durations.json").read_text())
    collected = manifest(project, 0)["collected"]
    now = partition([TestInfo(i) for i in collected], 2, learned)  # what today's file says
    assert [set(s) for s in now] != [set(s) for s in first], "the test would prove nothing"
    failing = next(n for n, s in enumerate(first) if "test_suite.py::test_t[3]" in s)

    (project / "broken").unlink()
    status, out = finished(submit_waiting(slurm, project, "--shard", str(failing), "2"))
    assert status == 0, out + outputs(project)
    assert ids(out)[0] == run and "every collected test ran exactly once and passed" in out
    assert selections(project) == first
    assert ET.parse(results / "junit.xml").getroot().get("failures") == "0"
    assert "the partition run " + run in outputs(project)

    (project / "broken").touch()  # by hand, on this node: the same run, the same share
    env = {**slurm.env, **job_env(slurm, project, CPQ_RUN_ID=run)}
    by_hand = subprocess.run(
        [sys.executable, "-m", "pytest", *PYTEST_ARGS, f"--cpq-shard={failing}/2",
         f"--cpq-results={results}"],
        cwd=project, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert by_hand.returncode == 1, by_hand.stdout + by_hand.stderr
    assert selections(project) == first
    merged = merge_here(results, "--run-id", run, "--junit", str(results / "junit.xml"))
    assert merged.returncode == 1, merged.stdout + merged.stderr
    assert "every collected test ran exactly once; 1 failed (exit 1)" in merged.stdout


def test_submit_refuses_an_option_before_n_that_is_not_its_own_nor_sbatchs(
    slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    project = make_project(tmp_path_factory, RERUN_SUITE)
    before = slurm.queue()
    for option in ("--cpq-world-size=2", "--cpq-torchrun", "--no-such-sbatch-option=1", "-k"):
        done = subprocess.run(
            [str(SLURM / "submit.sh"), "--wait", option, "2", "test_suite.py"],
            env={**slurm.env, **job_env(slurm, project)}, cwd=project, capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 4, done.stdout + done.stderr
        assert f"submit.sh: {option} (before N) is not an option of submit.sh" in done.stderr
        assert "pytest's options go after N" in done.stderr
        assert "usage: submit.sh [--wait]" in done.stderr
    bad = subprocess.run(
        [str(SLURM / "submit.sh"), "--wait", "2", "test_suite.py"],
        env={**slurm.env, **job_env(slurm, project, CPQ_POLL_S="soon")}, cwd=project,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 4 and "CPQ_POLL_S=soon is not a number" in bad.stderr
    assert slurm.queue() == before  # nothing was submitted
