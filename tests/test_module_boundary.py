"""The session boundary (docs/design.md, "Fidelity: the session boundary"): what a calling
session or a launch imported is forgotten before the next one, which imports it afresh as a
new process would; what the group preloaded stays warm.

Each test is a difference against a fresh run (``-p no:cpq`` sessions, the real torchrun),
on a private broker so that one group provably serves every session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import start_broker

from cpq import Client
from cpq.client.autostart import stop_broker


@pytest.fixture
def own_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, endpoint = start_broker(
        tmp_path_factory.mktemp("boundary-state"), "--max-ranks", "4", "--spares", "0"
    )
    yield endpoint
    stop_broker(process)


def _env(endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CPQ_"))}
    env.update(CPQ_ENDPOINT=endpoint, CPQ_AUTOSTART="0", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def _write(path: Path, text: str) -> None:
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(textwrap.dedent(text))
    if path.stat().st_mtime_ns <= before:  # a coarse file system clock: move it forward
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


def _launch(
    how: tuple[str, ...], script: str, cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``python -m HOW --nproc-per-node 2 SCRIPT`` (the real torchrun, or ``cpq torchrun``)."""
    return subprocess.run(
        [sys.executable, "-m", *how, "--nproc-per-node", "2", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _groups_started(endpoint: str) -> int:
    with Client(endpoint, name="boundary-test") as client:
        return int(client.status()["totals"]["groups_started"])


PROJECT_TEST = """
import pytest

import projmod


@pytest.mark.cpq(world_size=2)
def test_appends_to_a_fresh_list():
    projmod.SEEN.append(1)
    assert projmod.SEEN == [1]
    assert projmod.VERSION == {version}
"""


def test_a_project_modules_state_starts_afresh_in_each_session(
    own_broker: str, tmp_path: Path
) -> None:
    """Session 1 appends to a list in the project's module; session 2 finds it empty, as a
    fresh ``torchrun -m pytest`` would, on the same warm group; an edit of the module
    between sessions is read by the next one without a fresh group (the module was
    forgotten, so its file is no longer watched)."""
    _write(tmp_path / "projmod.py", "SEEN = []\nVERSION = 1\n")
    _write(tmp_path / "test_proj.py", PROJECT_TEST.format(version=1))
    env = _env(own_broker)

    def session(plain: bool) -> subprocess.CompletedProcess[str]:
        extra = ["-p", "no:cpq"] if plain else []
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    for _ in range(2):
        fresh, warm = session(plain=True), session(plain=False)
        assert fresh.returncode == 0, fresh.stdout
        assert warm.returncode == 0, warm.stdout + warm.stderr
    _write(tmp_path / "projmod.py", "SEEN = []\nVERSION = 2\n")
    _write(tmp_path / "test_proj.py", PROJECT_TEST.format(version=2))
    warm = session(plain=False)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert _groups_started(own_broker) == 1  # one warm group served all three sessions


ACCELERATE_SCRIPT = """
import os

from accelerate import PartialState

# A fresh worker has never built accelerate's state: a warm rank must not have either.
assert not PartialState._shared_state, "accelerate's state outlived the previous launch"
state = PartialState(cpu=True)
assert state.num_processes == int(os.environ["WORLD_SIZE"]) == 2, state.num_processes
state.wait_for_everyone()
print(f"STATE {state.process_index} of {state.num_processes}", flush=True)
state.destroy_process_group()
"""


def test_accelerate_state_starts_afresh_in_each_launch(own_broker: str, tmp_path: Path) -> None:
    """accelerate's ``PartialState`` launched twice with ``cpq torchrun`` (CPU, two ranks)
    gives rc 0 both times, as the real torchrun does (before the boundary: rc 1)."""
    pytest.importorskip("accelerate")
    (tmp_path / "state.py").write_text(ACCELERATE_SCRIPT)
    env = _env(own_broker, ACCELERATE_USE_CPU="true")

    def launch(*how: str) -> subprocess.CompletedProcess[str]:
        return _launch(how, "state.py", tmp_path, env)

    real = launch("torch.distributed.run")
    assert real.returncode == 0, real.stderr
    started = time.monotonic()
    for _ in range(2):
        warm = launch("cpq", "torchrun")
        assert warm.returncode == 0, warm.stdout + warm.stderr
        assert sorted(warm.stdout.split("\n"))[-2:] == ["STATE 0 of 2", "STATE 1 of 2"]
    assert _groups_started(own_broker) == 1, time.monotonic() - started


LEAVES_A_THREAD = """
import threading
import time

threading.Thread(target=time.sleep, args=(3600,), name="leftover-server", daemon=True).start()
print("started", flush=True)
"""


def test_a_thread_a_launch_leaves_is_named_where_its_group_is_recycled(tmp_path: Path) -> None:
    """A daemon thread that outlives its script (pytest-rerunfailures' ``run_server`` under
    ``-m pytest``, say) does not keep a worker alive: torchrun's status is 0, and cpq's. The
    rank still running it serves no other caller, and the reason names the thread, so that
    whoever reads why every launch lands on a new group can tell whose it is."""
    state = tmp_path / "state"
    process, endpoint = start_broker(state, "--max-ranks", "4", "--spares", "0")
    try:
        (tmp_path / "threads.py").write_text(LEAVES_A_THREAD)
        env = _env(endpoint)
        real = _launch(("torch.distributed.run",), "threads.py", tmp_path, env)
        warm = _launch(("cpq", "torchrun"), "threads.py", tmp_path, env)
        assert real.returncode == warm.returncode == 0, warm.stdout + warm.stderr
        assert warm.stdout.split() == ["started", "started"], warm.stdout
    finally:
        stop_broker(process)  # its log is whole once it has exited
    log = (state / "logs" / "broker.log").read_text()
    assert "the script left 1 thread(s) running (leftover-server)" in log, log[-3000:]
