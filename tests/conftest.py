"""One real broker for the whole test session (dogfooding cpq in its own tests).

Every test that needs groups talks to this broker, so a warm ws=2 gloo group started by the
first test serves all later ones; tests that must kill groups use their own pool spec (an
``env`` override) so they never take the shared warm group down. Tests that must kill the
broker itself start a private one with :func:`start_broker`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpq import Client
from cpq.autostart import broker_alive

ROOT = Path(__file__).resolve().parents[1]


def start_broker(state_dir: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """A real ``cpq-broker`` process on a private ipc endpoint; waits until it holds its lock."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    endpoint = f"ipc://{state_dir / 'broker.sock'}"
    env = dict(os.environ, CPQ_STATE_DIR=str(state_dir), PYTHONPATH=str(ROOT))
    log = open(state_dir / "broker.stdout", "ab")  # noqa: SIM115 - lives as long as the broker
    process = subprocess.Popen(
        [sys.executable, "-m", "cpq.cli", "broker", "--endpoint", endpoint, *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 30
    while not broker_alive(endpoint):
        assert process.poll() is None, (state_dir / "broker.stdout").read_text()
        assert time.monotonic() < deadline, "broker did not start"
        time.sleep(0.02)
    return process, endpoint


def stop_broker(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def broker_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cpq-state")
    path.chmod(0o700)
    return path


@pytest.fixture(scope="session")
def broker(broker_state: Path) -> Iterator[str]:
    """The shared broker's endpoint (also exported as CPQ_ENDPOINT for pytester runs)."""
    process, endpoint = start_broker(broker_state, "--max-ranks", "6")
    old = {k: os.environ.get(k) for k in ("CPQ_ENDPOINT", "CPQ_STATE_DIR")}
    os.environ["CPQ_ENDPOINT"] = endpoint
    os.environ["CPQ_STATE_DIR"] = str(broker_state)
    try:
        yield endpoint
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        stop_broker(process)


@pytest.fixture
def client(broker: str) -> Iterator[Client]:
    with Client(broker, name="pytest") as c:
        yield c
