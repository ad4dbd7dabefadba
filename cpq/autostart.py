"""The embedded default: start a background broker when none serves the endpoint.

Many processes may race here at once (every pytest-xdist worker of a session, several
sessions on one node). A file lock serialises them and the broker's own endpoint lock
settles who serves, so exactly one broker starts; the others find it running. The
started broker exits by itself after ``idle_exit_s`` without clients or tasks.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from pathlib import Path

from cpq import paths

DEFAULT_IDLE_EXIT_S = 600.0


def broker_alive(endpoint: str) -> bool:
    """True if a broker on this node holds ``endpoint``'s lock (no message needed)."""
    lock = paths.lock_path(endpoint)
    try:
        handle = open(lock)  # noqa: SIM115
    except FileNotFoundError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def ensure_broker(
    endpoint: str, idle_exit_s: float = DEFAULT_IDLE_EXIT_S, extra_args: list[str] | None = None
) -> bool:
    """Start a broker for ``endpoint`` unless one runs; True if this call started it."""
    if broker_alive(endpoint):
        return False
    state = paths.state_dir()
    with open(state / "autostart.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if broker_alive(endpoint):
            return False
        log_dir = paths.ensure_private_dir(state / "logs")
        log_path = log_dir / "broker-autostart.log"
        command = [
            sys.executable,
            "-m",
            "cpq.cli",
            "broker",
            "--endpoint",
            endpoint,
            "--idle-exit",
            str(idle_exit_s),
            *(extra_args or []),
        ]
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd="/",
            )
        deadline = time.monotonic() + 30
        while not broker_alive(endpoint):
            if process.poll() is not None:
                raise RuntimeError(
                    f"the background broker exited with status {process.returncode}:\n"
                    + _tail(log_path)
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the background broker did not start within 30s:\n{_tail(log_path)}"
                )
            time.sleep(0.02)
        return True


def _tail(path: Path, size: int = 3000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-size:].decode("utf-8", errors="replace")


__all__ = ["DEFAULT_IDLE_EXIT_S", "broker_alive", "ensure_broker"]
