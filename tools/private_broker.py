"""A private broker for one benchmark mode: its own state dir, ipc endpoint and log folder.

Benchmarks compare ways of running one suite side by side; each cpq mode gets a fresh
broker so no warm group, timing history or client of one mode leaks into the next. Its
start-up time is kept apart (``start_s``): a node's broker normally outlives sessions.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from cpq import Client
from cpq.autostart import spawn_broker, stop_broker


class PrivateBroker:
    def __init__(self, state: Path, log_dir: Path, gpus: str, env: dict[str, str]) -> None:
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
            ["--gpus", gpus, "--log-dir", str(log_dir)],
            env=self.env,
            log_path=log_dir / "broker.stdout",
            cwd=Path(__file__).resolve().parents[1],
            timeout_s=60,
        )
        self.start_s = time.perf_counter() - start

    def status(self) -> dict[str, Any]:
        """The ``cpq-status --json`` object, now."""
        with Client(self.endpoint, name="benchmark-status") as client:
            return client.status()

    def stop(self) -> None:
        stop_broker(self.process)
