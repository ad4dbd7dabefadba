"""A warm launch's output is torchrun's: every rank's lines and tracebacks, also when rank 1
raises while rank 0 waits in a barrier; the ``[rank<r>]: `` prefix of an uncaught
exception (``[default<r>]:[rank<r>]: `` under ``--tee``); an absolute ``__file__``; the
``ChildFailedError`` summary with its root cause. Each is compared with the real torchrun
(``python -m torch.distributed.run`` of this interpreter) on the shared broker.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BARRIER = """
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} before the barrier file {__file__} argv0 {sys.argv[0]}", flush=True)
if rank == 1:
    raise ValueError("rank one broke")
dist.barrier()
print("never printed")
"""

REAL = [sys.executable, "-m", "torch.distributed.run"]
WARM = [sys.executable, "-m", "cpq", "torchrun"]


@pytest.fixture
def script(tmp_path: Path, broker: str) -> Path:
    (tmp_path / "barrier.py").write_text(BARRIER)
    return tmp_path


def _launch(how: list[str], folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*how, "--nproc-per-node", "2", *args, "barrier.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _root_cause_rank(stderr: str) -> str:
    found = re.search(
        r"Root Cause \(first observed failure\):\n\[0\]:\n(?:.*\n){2}\s+rank\s+: (\d)", stderr
    )
    assert found, stderr
    return found.group(1)


def test_rank_one_raises_while_rank_zero_waits_in_a_barrier(script: Path) -> None:
    real, warm = _launch(REAL, script), _launch(WARM, script)
    assert real.returncode == warm.returncode == 1
    for done in (real, warm):
        # both ranks' lines, __file__ absolute and argv[0] as given (the real torchrun's two
        # ranks share one stdout: a line's text and its newline may interleave)
        lines = sorted(
            re.findall(r"rank \d before the barrier file \S+? argv0 \S+?\.py", done.stdout)
        )
        assert lines == [
            f"rank {r} before the barrier file {script / 'barrier.py'} argv0 barrier.py"
            for r in (0, 1)
        ], done.stdout
        # both tracebacks, with torch's prefix: rank 1's own, rank 0's from the barrier
        assert "[rank1]: ValueError: rank one broke" in done.stderr, done.stderr
        assert f'[rank1]:   File "{script / "barrier.py"}", line 10, in <module>' in done.stderr
        assert re.search(r"\[rank0\]: RuntimeError: .*by peer", done.stderr), done.stderr
        assert "ChildFailedError: \n" in done.stderr
        assert "barrier.py FAILED" in done.stderr
        _root_cause_rank(done.stderr)
    # the first to fail is the root cause (torchrun's own order varies with its polling)
    assert _root_cause_rank(warm.stderr) == "1"
    assert "cpq torchrun: running the real torchrun" not in warm.stderr


def test_tee_prefixes_the_rank_prefix(script: Path) -> None:
    real, warm = _launch(REAL, script, "--tee", "3"), _launch(WARM, script, "--tee", "3")
    assert real.returncode == warm.returncode == 1
    for done in (real, warm):
        assert "[default1]:[rank1]: ValueError: rank one broke" in done.stderr, done.stderr
        assert "[default0]:rank 0 before the barrier" in done.stdout, done.stdout


STOPPED = """
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    sys.exit(2)
print("rank 1 started", flush=True)
print("rank 1 warns", file=sys.stderr, flush=True)
time.sleep(60)  # still running when its peer has failed: the agent stops it
"""


def test_a_rank_still_running_when_its_peer_failed_shows_what_it_printed(
    tmp_path: Path, broker: str
) -> None:
    """torchrun stops the other workers with SIGTERM once one fails: what they printed is on
    the terminal, and the summary gives them exit code -15. A warm rank stuck after its peer
    failed is stopped by the broker: its output so far comes with its stack (it was lost),
    and the summary says what torchrun's does."""
    (tmp_path / "stopped.py").write_text(STOPPED)

    def launch(how: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*how, "--nproc-per-node", "2", "stopped.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )

    real, warm = launch(REAL), launch(WARM)
    assert real.returncode == warm.returncode == 1
    for done in (real, warm):
        assert "rank 1 started" in done.stdout, done.stdout + done.stderr
        assert "rank 1 warns" in done.stderr, done.stderr
        assert re.search(r"exitcode\s+: -15 \(pid: \d+\)", done.stderr), done.stderr
        assert re.search(r"Signal 15 \(SIGTERM\) received by PID \d+", done.stderr), done.stderr
        assert re.search(r"exitcode\s+: 2 \(pid: \d+\)", done.stderr), done.stderr
        assert _root_cause_rank(done.stderr) == "0"
