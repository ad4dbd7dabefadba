"""What the benchmarks share: their children's environment, a logged child run with a
time-out that takes down the whole process tree, and a private broker per mode.

Imports nothing of cpq at module level: ``bench_te.py --driver`` and ``bench_cp.py
--one-case`` run under torchrun and time their own imports.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]


def child_env(repo_first: bool = True) -> dict[str, str]:
    """Every child's environment: the repo on PYTHONPATH (before what PYTHONPATH already
    holds, or after it: ``/tmp/site`` on the GPU host must win), unbuffered output, and no
    stray cpq endpoint or pytest options from the caller."""
    env = dict(os.environ)
    given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts = [str(ROOT), *given] if repo_first else [*given, str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env["PYTHONUNBUFFERED"] = "1"
    for key in ("CPQ_ENDPOINT", "CPQ_STATE_DIR", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER"):
        env.pop(key, None)
    return env


def plugin_args() -> list[str]:
    """``-p cpq.client.plugin`` where cpq is only on ``PYTHONPATH`` (the GPU host: no entry
    point registers it), nothing where it is installed (naming it twice is an error)."""
    import importlib.metadata

    entries = importlib.metadata.entry_points(group="pytest11")
    return [] if any(ep.name == "cpq" for ep in entries) else ["-p", "cpq.client.plugin"]


class Run(NamedTuple):
    rc: int
    wall_s: float
    started_at: float  # time.time() at launch
    ended_at: float  # time.time() at exit


def run_logged(
    cmd: list[str], log_path: Path, env: dict[str, str], cwd: Path, timeout: float
) -> Run:
    """Run ``cmd`` to completion with its output appended to ``log_path``.

    The child leads its own session, so a time-out takes down everything it started
    (torchrun's ranks too): the exit status is then 124, as ``timeout(1)`` gives.
    """
    with open(log_path, "ab") as out:
        out.write(f"$ {shlex.join(cmd)}\n".encode())
        out.flush()
        started_at = time.time()
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        wall = time.perf_counter() - start
        out.write(f"[rc {rc}, {wall:.2f} s]\n".encode())
    return Run(rc, wall, started_at, time.time())


class PrivateBroker:
    """A broker for one benchmark mode: its own state dir, ipc endpoint and log folder.

    Each cpq mode gets a fresh one, so no warm group, timing history or client of one mode
    leaks into the next. Its start-up time is kept apart (``start_s``): a node's broker
    normally outlives sessions.
    """

    def __init__(
        self,
        state: Path,
        log_dir: Path,
        gpus: str,
        env: dict[str, str],
        extra: tuple[str, ...] = (),
    ) -> None:
        from cpq.client.autostart import spawn_broker

        state.mkdir(mode=0o700, parents=True, exist_ok=True)
        state.chmod(0o700)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.state, self.log_dir = state, log_dir
        self.endpoint = f"ipc://{state / 'broker.sock'}"
        #: The environment of the broker, and of every client meant to reach it.
        self.env = dict(env, CPQ_STATE_DIR=str(state), CPQ_ENDPOINT=self.endpoint)
        start = time.perf_counter()
        self.process = spawn_broker(
            self.endpoint,
            ["--gpus", gpus, "--log-dir", str(log_dir), *extra],
            env=self.env,
            log_path=log_dir / "broker.stdout",
            cwd=ROOT,
            timeout_s=60,
        )
        self.start_s = time.perf_counter() - start

    def status(self) -> dict[str, Any]:
        """The ``cpq-status --json`` object, now."""
        from cpq import Client

        with Client(self.endpoint, name="benchmark-status") as client:
            return client.status()

    def stop(self) -> None:
        from cpq.client.autostart import stop_broker

        stop_broker(self.process)


@contextlib.contextmanager
def cpu_broker(prefix: str, *args: str) -> Any:
    """``with cpu_broker("cpq-bench-") as (endpoint, process):`` a ``cpq-broker`` of the
    benchmark's own (a fresh state folder, ``--gpus none``, ``args`` added), serving when
    entered; terminated and its folder removed on the way out."""
    import sys
    import tempfile

    from cpq.client.autostart import broker_alive

    state = Path(tempfile.mkdtemp(prefix=prefix))
    endpoint = f"ipc://{state / 'broker.sock'}"
    process = subprocess.Popen(
        [sys.executable, "-m", "cpq.broker", "--endpoint", endpoint, "--gpus", "none", *args],
        env=dict(os.environ, CPQ_STATE_DIR=str(state)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not broker_alive(endpoint):
            time.sleep(0.01)
        yield endpoint, process
    finally:
        process.terminate()
        process.wait(timeout=30)
        shutil.rmtree(state, ignore_errors=True)
