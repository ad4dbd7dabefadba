"""Fidelity on GPUs: a user's own project, sessions through cpq on an H200 pair (nccl).

What the CPU test suite cannot show: groups started with nothing of the broker's
environment still come up on GPUs (CUDA, NCCL), the caller's ``CUDA_VISIBLE_DEVICES``
narrows the physical GPU a group gets, an ``NCCL_*`` start variable gets a group of its
own, a task variable reaches the ranks, and an edit of a helper module between sessions is
seen. Each scenario runs one pytest session of a project written to a temp directory,
against one broker that owns both GPUs, and prints one line; the exit status says whether
every verdict was the expected one.

Usage (repo root, on the GPU host, cpq importable): ``python3 tools/gpu/fidelity_check.py``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SUITE = """
import os
import pytest
import torch
import torch.distributed as dist
from mylib import answer


@pytest.mark.cpq(world_size=2)
def test_nccl_all_reduce():
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    assert dist.get_backend() == "nccl" and t.tolist() == [2.0] * 4


@pytest.mark.cpq(world_size=2)
def test_helper_answer():
    assert answer() == int(os.environ["MYPROJ_EXPECT"])


@pytest.mark.cpq(world_size=2)
def test_task_variable():
    assert os.environ.get("NVTE_MYPROJ_FLAG") == os.environ["MYPROJ_EXPECT_FLAG"]


@pytest.mark.cpq(world_size=1)
def test_physical_gpu():
    # the broker assigns CUDA_VISIBLE_DEVICES; the caller's value chose which GPU
    assert os.environ["CUDA_VISIBLE_DEVICES"] == os.environ["MYPROJ_EXPECT_GPU"]
    assert torch.cuda.device_count() == 1
"""


def session(project: Path, env: dict[str, str], *args: str) -> tuple[dict[str, str], float]:
    """One pytest session: ({test: outcome}, wall seconds)."""
    started = time.monotonic()
    # -p cpq.client.plugin: on the GPU host cpq is on PYTHONPATH, not installed (no entry point)
    plugin = [] if _installed() else ["-p", "cpq.client.plugin"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *plugin, *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.monotonic() - started
    outcomes = {}
    for line in done.stdout.splitlines():
        for word in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
            if line.startswith(word + " "):
                outcomes[line.split()[1].split("::")[-1]] = word.lower()
    if not outcomes:
        print(done.stdout[-3000:], done.stderr[-2000:])
    return outcomes, wall


def _installed() -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("cpq")
    except PackageNotFoundError:
        return False
    return True


def main() -> int:
    project = Path(tempfile.mkdtemp(prefix="cpq-gpu-fidelity-"))
    (project / "test_gpu.py").write_text(textwrap.dedent(SUITE))
    (project / "mylib.py").write_text("def answer():\n    return 41\n")
    state = Path(tempfile.mkdtemp(prefix="cpq-gpu-state-"))
    state.chmod(0o700)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CPQ_", "MYPROJ_"))}
    base.update(CPQ_STATE_DIR=str(state), CPQ_ENDPOINT=f"ipc://{state / 'broker.sock'}")
    broker = subprocess.Popen(
        [sys.executable, "-m", "cpq.broker", "--gpus", "0,1", "--idle-exit", "120"],
        env={**base, "MYPROJ_BROKER_ONLY": "1"},
        stdout=(state / "broker.out").open("w"),
        stderr=subprocess.STDOUT,
    )
    rows: list[tuple[str, dict[str, str], dict[str, str], float]] = []
    ok = True

    def run(name: str, expect: dict[str, str], extra: dict[str, str | None], *args: str) -> None:
        nonlocal ok
        env = {**base, **{k: v for k, v in extra.items() if v is not None}}
        for key in [k for k, v in extra.items() if v is None]:
            env.pop(key, None)
        got, wall = session(project, env, *args)
        rows.append((name, expect, got, wall))
        ok &= all(got.get(test) == outcome for test, outcome in expect.items())

    try:
        common = {"MYPROJ_EXPECT": "41", "MYPROJ_EXPECT_FLAG": "on", "NVTE_MYPROJ_FLAG": "on"}
        run(
            "cold session: nccl group, helper, task variable",
            {
                "test_nccl_all_reduce": "passed",
                "test_helper_answer": "passed",
                "test_task_variable": "passed",
            },
            common,
            "-k",
            "not physical",
        )
        run(
            "warm session, NVTE_MYPROJ_FLAG unset in the shell",
            {"test_task_variable": "failed"},
            {**common, "NVTE_MYPROJ_FLAG": None},
            "-k",
            "task_variable",
        )
        (project / "mylib.py").write_text("def answer():\n    return 42\n")
        run(
            "helper edited 41 -> 42, shell still expects 41",
            {"test_helper_answer": "failed"},
            common,
            "-k",
            "helper",
        )
        run(
            "helper edited, shell expects 42",
            {"test_helper_answer": "passed"},
            {**common, "MYPROJ_EXPECT": "42"},
            "-k",
            "helper",
        )
        run(
            "NCCL_DEBUG=WARN (a start variable): its own group",
            {"test_nccl_all_reduce": "passed"},
            {**common, "NCCL_DEBUG": "WARN"},
            "-k",
            "nccl",
        )
        for gpu in ("1", "0"):
            run(
                f"CUDA_VISIBLE_DEVICES={gpu} in the shell: ws1 group on physical GPU {gpu}",
                {"test_physical_gpu": "passed"},
                {**common, "CUDA_VISIBLE_DEVICES": gpu, "MYPROJ_EXPECT_GPU": gpu},
                "-k",
                "physical",
            )
        status = subprocess.run(
            [sys.executable, "-m", "cpq", "status", "--json"],
            env=base,
            capture_output=True,
            text=True,
            timeout=60,
        )
        pools = json.loads(status.stdout)["pools"]
        totals = json.loads(status.stdout)["totals"]
    finally:
        subprocess.run([sys.executable, "-m", "cpq", "stop"], env=base, timeout=60)
        broker.wait(timeout=60)

    print(f"\ncpq fidelity on GPUs ({'all as expected' if ok else 'UNEXPECTED VERDICTS'})")
    for name, expect, got, wall in rows:
        mark = "ok " if all(got.get(t) == o for t, o in expect.items()) else "BAD"
        print(f"  {mark} {wall:6.1f}s  {name}: {got}")
    for p in pools:
        env = {k: v for k, v in p["env"].items() if k.startswith(("NCCL_DEBUG", "CUDA_VIS"))}
        print(
            f"  group {p['id']} {p['spec']} gpus={p['gpus']} state={p['state']} "
            f"tasks={p['tasks_done']} {env}"
        )
    print(
        f"  totals: groups_started={totals['groups_started']} "
        f"recycled={totals['groups_recycled']} passed={totals['passed']} "
        f"failed={totals['failed']} errors={totals['errors']}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
