"""CI fan-out on a real two-node Slurm cluster, through the shipped sbatch template.

A generated marker suite (34 tests: 30 ``@pytest.mark.cpq(world_size=1)`` tests that sleep a
known time and all_reduce on a warm group, 4 unmarked) runs as array shards; each shard
autostarts its node's own broker (state under the job's ``TMPDIR``), and ``cpq merge``
judges the results. The jobs get a clean environment: nothing of this session's broker
(``CPQ_ENDPOINT``, ``CPQ_STATE_DIR``) or of pytest reaches them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .slurm import SlurmCluster, wait_until

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "tools" / "ci" / "slurm" / "cpq-shards.sbatch"
#: Six long tests and many short ones: a split by count would put the long ones unevenly.
SECONDS = [1.2 if n % 5 == 0 else 0.15 for n in range(30)]

SUITE = f"""
import time

import pytest

SECONDS = {SECONDS!r}


@pytest.mark.cpq(world_size=1)
@pytest.mark.parametrize("n", range(len(SECONDS)))
def test_work(n):
    import torch
    import torch.distributed as dist

    time.sleep(SECONDS[n])
    value = torch.full((4,), float(n))
    dist.all_reduce(value)
    assert value[0].item() == n * dist.get_world_size()


@pytest.mark.parametrize("n", range(4))
def test_local(n):
    assert n < 4
"""

ALL_TESTS = [f"test_suite.py::test_work[{n}]" for n in range(30)] + [
    f"test_suite.py::test_local[{n}]" for n in range(4)
]


@pytest.fixture
def project(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite, and a durations file that knows what each test costs."""
    path = Path(tmp_path_factory.mktemp("fanout", numbered=True))
    path.chmod(0o755)
    (path / "test_suite.py").write_text(SUITE)
    recorded = {f"test_suite.py::test_work[{n}]": s + 0.02 for n, s in enumerate(SECONDS)}
    recorded |= {f"test_suite.py::test_local[{n}]": 0.001 for n in range(4)}
    recorded["cpq:spawn:ws1"] = 4.0
    (path / "durations.json").write_text(json.dumps(recorded))
    return path


def submit(
    cluster: SlurmCluster,
    project: Path,
    results: Path,
    array: str = "0-1",
    args: tuple[str, ...] = (),
    **env: str,
) -> str:
    """sbatch the template as a user would; the array's job id."""
    job_env = {
        "PYTHONPATH": str(ROOT),
        "CPQ_PYTHON": sys.executable,
        "CPQ_RESULTS": str(results),
        "CPQ_WORKDIR": str(project),
        "CPQ_DURATIONS": str(project / "durations.json"),
        "TMPDIR": str(cluster.dir),  # node-local state: under the cluster, found at teardown
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        **env,
    }
    out = cluster.run(
        "sbatch", "--parsable", f"--array={array}", f"--output={results.parent}/%x-%A_%a.out",
        str(TEMPLATE), "-p", "cpq.client.plugin", "-p", "no:cacheprovider", "-q", *args,
        env=job_env,
    )  # fmt: skip
    return out.strip().split(";")[0]


def wait_done(cluster: SlurmCluster, job: str, within: float = 120) -> None:
    wait_until(f"end of job {job}", lambda: not cluster.queue(job), within=within, every=0.25)


def merge(results: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cpq", "merge", *args, str(results)],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def manifests(results: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(results.glob("shard-*.json"))]


def outputs(results: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(results.parent.glob("*.out")))


def test_two_nodes_run_every_test_once_with_balanced_walls(
    slurm: SlurmCluster, project: Path
) -> None:
    results = project / "results"
    job = submit(slurm, project, results)
    wait_done(slurm, job)
    merged = merge(
        results, "--junit", str(project / "junit.xml"), "--durations", str(project / "next.json")
    )
    assert merged.returncode == 0, merged.stdout + merged.stderr + outputs(results)
    data = manifests(results)
    assert [d["hostname"] for d in data] == ["n1", "n2"] or len({d["hostname"] for d in data}) == 2
    ran = sorted(t for d in data for t in d["tests"])  # type: ignore[attr-defined]
    assert ran == sorted(ALL_TESTS)  # every test, once
    walls = [float(d["wall_s"]) for d in data]  # type: ignore[arg-type]
    assert max(walls) / min(walls) <= 1.25, (walls, merged.stdout)
    assert all(d["spawns"] == 1 for d in data), data
    assert "every collected test ran exactly once and passed" in merged.stdout
    learned = json.loads((project / "next.json").read_text())
    assert learned["cpq:spawn:ws1"] > 0  # the wait for the group, learned as a spawn cost
    for n, seconds in enumerate(SECONDS):  # and not charged to the test that waited
        assert seconds <= learned[f"test_suite.py::test_work[{n}]"] < seconds + 1.0, learned
    junit = (project / "junit.xml").read_text()
    assert junit.count("<testcase ") == len(ALL_TESTS)


def test_a_cancelled_shard_is_named_then_a_requeue_completes_the_run(
    slurm: SlurmCluster, project: Path
) -> None:
    results = project / "results"
    job = submit(slurm, project, results)
    started = results / "shard-1-of-2.json"
    wait_until("shard 1's share on disk", started.exists, within=90)
    owed = json.loads(started.read_text())["selected"]
    slurm.run("scancel", f"{job}_1")
    wait_done(slurm, job)
    assert slurm.state(f"{job}_1") == "CANCELLED"
    merged = merge(results)
    assert merged.returncode == 2, merged.stdout + merged.stderr
    assert f"MISSING ({len(owed)}): " in merged.stdout
    for test_id in owed:
        assert test_id in merged.stdout
    assert "shard 1/2 on n" in merged.stdout and "did not finish" in merged.stdout
    state_dirs = f"{slurm.dir}/cpq-{job}"
    wait_until("no process of the cancelled shard", lambda: not _processes(state_dirs), 30)

    slurm.run("scontrol", "requeue", f"{job}_1")
    slurm.run("scontrol", "update", f"jobid={job}_1", "StartTime=now")
    wait_until(
        "the requeued shard's result",
        lambda: json.loads(started.read_text()).get("complete") is True,
        within=120,
        every=0.25,
    )
    wait_done(slurm, job)
    merged = merge(results)
    assert merged.returncode == 0, merged.stdout + merged.stderr + outputs(results)
    (shard0, shard1) = manifests(results)
    assert shard1["restart_count"] == 1 and shard0["restart_count"] == 0
    assert sorted([*shard0["tests"], *shard1["tests"]]) == sorted(ALL_TESTS)  # type: ignore[misc]


def test_shards_with_different_durations_are_detected(slurm: SlurmCluster, project: Path) -> None:
    """Two shards that balanced on different durations files cannot both be trusted.

    Only the unmarked tests (``-k test_local``): no group is needed to show it."""
    results = project / "results"
    other = {"test_suite.py::test_local[0]": 60.0, "test_suite.py::test_local[1]": 1.0}
    (project / "other.json").write_text(json.dumps(other))
    local = ("-k", "test_local")
    first = submit(slurm, project, results, array="0", args=local, CPQ_SHARD="0/2")
    second = submit(
        slurm, project, results, array="0", args=local, CPQ_SHARD="1/2",
        CPQ_DURATIONS=str(project / "other.json"),
    )  # fmt: skip
    wait_done(slurm, first)
    wait_done(slurm, second)
    merged = merge(results)
    assert merged.returncode == 2, merged.stdout + merged.stderr + outputs(results)
    assert "shards computed different selections" in merged.stdout
    assert "0/2" in merged.stdout and "1/2" in merged.stdout


def _processes(needle: str) -> list[int]:
    """Pids whose environment names a state directory starting with ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"CPQ_STATE_DIR={needle}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
