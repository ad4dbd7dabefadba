"""Starting broker processes: the embedded default, and the helper everything else uses.

:func:`ensure_broker` starts a background broker when none serves the endpoint.

Many processes may race here at once (every pytest-xdist worker of a session, several
sessions on one node). A file lock serialises them and the broker's own endpoint lock
settles who serves, so exactly one broker starts; the others find it running. The
started broker exits by itself after ``idle_exit_s`` without clients or tasks.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cpq import __version__, lockfile, osutil, paths
from cpq.lockfile import code_fingerprint

log = logging.getLogger("cpq.client.autostart")

DEFAULT_IDLE_EXIT_S = 600.0


def code_difference(broker: dict[str, Any]) -> str:
    """How a broker's cpq code differs from this process's, for a warning: the versions
    when they differ, else the code fingerprints (:func:`code_fingerprint`: an edited
    editable install keeps its version number, and "0.1.0 than 0.1.0" says nothing)."""
    theirs, ours = broker.get("version", "?"), __version__
    if theirs != ours:
        return f"cpq {theirs} there, {ours} here"
    return (
        f"cpq {ours} both, but its source files differ: code {broker.get('code', '?')} "
        f"there, {code_fingerprint()} here (an edit or reinstall since it started)"
    )


def broker_alive(endpoint: str) -> bool:
    """True if a broker on this node holds ``endpoint``'s lock (no message needed)."""
    return lockfile.held(endpoint)


def ensure_broker(
    endpoint: str, idle_exit_s: float = DEFAULT_IDLE_EXIT_S, extra_args: list[str] | None = None
) -> bool:
    """Start a broker for ``endpoint`` unless one runs; True if this call started it.

    ``CPQ_BROKER_ARGS`` (shell words) are added to the broker's command line: a CI
    template has no other way to give the broker a session autostarts its options
    (``--max-ranks 4``); a broker that already runs keeps its own.

    A running background broker of other cpq code is replaced when nothing uses it (see
    :func:`replace_if_stale`), so an upgrade takes effect at the next test session instead
    of after the old broker's idle exit.
    """
    if broker_alive(endpoint) and lockfile.names_this_code(endpoint):
        return False  # the usual case: no lock taken, no connection made
    state = paths.state_dir()
    with open(state / "autostart.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if broker_alive(endpoint) and not replace_if_stale(endpoint):
            return False
        log_dir = paths.ensure_private_dir(state / "logs")
        spawn_broker(
            endpoint,
            ["--idle-exit", str(idle_exit_s), *broker_args_from_env(), *(extra_args or [])],
            log_path=log_dir / "broker-autostart.log",
            cwd="/",
            detach=True,
        )
        return True


BROKER_ARGS_VAR = "CPQ_BROKER_ARGS"


def broker_args_from_env() -> list[str]:
    """The broker options in ``CPQ_BROKER_ARGS``; a clear error for unbalanced quotes."""
    try:
        return shlex.split(os.environ.get(BROKER_ARGS_VAR, ""))
    except ValueError as exc:
        raise ValueError(f"{BROKER_ARGS_VAR}: {exc}") from None


def replace_if_stale(endpoint: str, wait_s: float = 30.0) -> bool:
    """Stop the broker at ``endpoint`` if it runs other cpq code, was started to exit when
    idle (``--idle-exit``, as background brokers are) and nothing uses it now; True if it
    is gone. A broker started by hand, or one with clients or tasks, is left alone with a
    warning: stopping it would take warm groups or verdicts from someone else.
    """
    from cpq.client.api import BrokerUnavailable, Client

    try:
        with Client(endpoint, name=_CHECKER, connect_timeout_s=10) as client:
            broker = client.broker
            if broker.get("code", code_fingerprint()) == code_fingerprint():
                return False
            status = client.status()
            others = [c for c in status["clients"] if c["name"] != _CHECKER]
            busy = status["queue"] or others or any(p["task"] for p in status["pools"])
            if not broker.get("idle_exit_s") or busy:
                log.warning(
                    "the broker at %s (pid %s) runs other cpq code than this process (%s); "
                    "it is %s, so it stays: stop it (cpq stop) to pick up this code",
                    endpoint,
                    broker.get("pid"),
                    code_difference(broker),
                    "in use" if busy else "not a background broker",
                )
                return False
            log.warning(
                "replacing the idle background broker at %s (pid %s): it runs other cpq code "
                "than this process (%s)",
                endpoint,
                broker.get("pid"),
                code_difference(broker),
            )
            client.stop()
    except BrokerUnavailable as error:
        log.warning("could not check the broker at %s: %s", endpoint, error)
        return False
    deadline = time.monotonic() + wait_s
    while broker_alive(endpoint):  # it kills its groups, then lets go of the endpoint lock
        if time.monotonic() > deadline:
            log.warning("the stale broker at %s did not stop within %gs", endpoint, wait_s)
            return False
        time.sleep(0.02)
    return True


_CHECKER = "cpq-autostart-check"


class BrokerStartError(RuntimeError):
    """A broker process exited, or did not take its endpoint in time; the message ends
    with the tail of its log, which says why."""


def spawn_broker(
    endpoint: str,
    args: Sequence[str] = (),
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    detach: bool = False,
    timeout_s: float = 30.0,
) -> subprocess.Popen[bytes]:
    """Start ``python -m cpq.broker --endpoint ENDPOINT *ARGS`` and wait until it serves.

    "Serves" is :func:`cpq.lockfile.serving`: the broker holds the endpoint's lock and has
    bound both sockets (it says so in the lock file after the bind), so the endpoint's
    socket file exists and a client gets answers from the moment this returns. ``detach``
    puts it in a session of its own (the autostarted broker outlives the pytest session
    that started it). The one way cpq, its tests and its tools start a broker process.
    """
    command = osutil.broker_command("--endpoint", endpoint, *args)
    with open(log_path, "ab") as log_file:  # the child keeps its own copy of the fd
        process = subprocess.Popen(
            command,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=detach,
            cwd=cwd,
        )
    deadline = time.monotonic() + timeout_s
    while not lockfile.serving(endpoint):
        if process.poll() is not None:
            raise BrokerStartError(
                f"the broker exited with status {process.returncode}:\n{_tail(log_path)}"
            )
        if time.monotonic() > deadline:
            stop_broker(process)
            raise BrokerStartError(
                f"the broker did not start within {timeout_s:g}s:\n{_tail(log_path)}"
            )
        time.sleep(0.02)
    return process


def stop_broker(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    """SIGTERM (the broker kills its groups as whole sessions), then SIGKILL if it lingers.

    Returns the exit status."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def _tail(path: Path, size: int = 3000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-size:].decode("utf-8", errors="replace")


__all__ = [
    "DEFAULT_IDLE_EXIT_S",
    "BrokerStartError",
    "broker_alive",
    "code_difference",
    "code_fingerprint",
    "ensure_broker",
    "replace_if_stale",
    "spawn_broker",
    "stop_broker",
]
