"""Where cpq keeps its sockets, lock and logs, and the default endpoint.

The default endpoint is an ``ipc://`` socket inside a per-user directory of mode 0700: the
file system is the access control (docs/design.md, "Trust"), so the directory is checked every
time it is used and refused when someone else owns it or others can enter it.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

ENDPOINT_VAR = "CPQ_ENDPOINT"
STATE_DIR_VAR = "CPQ_STATE_DIR"
TIMEOUT_VAR = "CPQ_TIMEOUT"
DEFAULT_TIMEOUT_S = 90.0


class UnsafeStateDir(RuntimeError):
    """The state directory is owned by another user or open to others."""


def state_dir() -> Path:
    """The per-user directory for sockets, the broker lock and logs (created 0700)."""
    explicit = os.environ.get(STATE_DIR_VAR)
    if explicit:
        path = Path(explicit)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "cpq"
    else:
        path = Path(f"/tmp/cpq-{os.getuid()}")
    return ensure_private_dir(path)


def ensure_private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeStateDir(f"{path} is not a plain directory")
    if info.st_uid != os.getuid():
        raise UnsafeStateDir(f"{path} is owned by uid {info.st_uid}, not by you ({os.getuid()})")
    if info.st_mode & 0o077:
        raise UnsafeStateDir(
            f"{path} has mode {stat.S_IMODE(info.st_mode):o}; it must be 0700 "
            f"(fix: chmod 700 {path})"
        )
    return path


def default_endpoint() -> str:
    return os.environ.get(ENDPOINT_VAR) or f"ipc://{state_dir() / 'broker.sock'}"


def default_timeout() -> float:
    raw = os.environ.get(TIMEOUT_VAR)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_VAR}={raw!r} is not a number of seconds") from None
    if not 0 < value < math.inf:
        raise ValueError(f"{TIMEOUT_VAR} must be a positive, finite number, got {raw!r}")
    return value


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


def lock_path(endpoint: str) -> Path:
    """One lock file per endpoint: whoever holds it is the broker serving that endpoint."""
    path = ipc_path(endpoint)
    if path is not None:
        return path.with_name(path.name + ".lock")
    safe = "".join(c if c.isalnum() else "_" for c in endpoint)
    return state_dir() / f"{safe}.lock"
