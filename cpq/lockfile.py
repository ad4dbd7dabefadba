"""The endpoint's lock file: who serves an endpoint, and which cpq code it runs.

The one owner of the file's format. The broker takes the lock (an exclusive ``flock`` held
for its whole life) and writes two lines into the file, its pid and its
:func:`code_fingerprint`, then a third, ``serving``, once both its sockets are bound
(:func:`mark_serving`); clients (``cpq.client.autostart``) test the lock without a message and
read the second line to tell a broker of older code from one running this code. A file
with fewer lines (a broker older than this format) counts as this code. See
``docs/design.md``, "Processes and sockets".
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cpq import paths

_PACKAGE = Path(__file__).parent


class LockHeld(RuntimeError):
    """Another process holds the endpoint's lock: another broker serves it."""


@dataclass(frozen=True)
class Owner:
    """What a serving broker wrote into its lock file."""

    pid: int | None
    code: str | None


@functools.cache
def code_fingerprint() -> str:
    """Which cpq code this process runs: a hash of the package's source files' names, sizes
    and modification times. It tells a background broker started before ``pip install -U
    cpq`` (or before an edit of an editable install) from one running this code."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        info = path.stat()
        name = path.relative_to(_PACKAGE).as_posix()
        digest.update(f"{name}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def acquire(endpoint: str) -> IO[str]:
    """Take ``endpoint``'s lock for this process's life and write the owner lines into it.

    Raises :class:`LockHeld` when another broker holds it. The returned file must stay
    open: closing it lets go of the endpoint.
    """
    handle = open(paths.lock_path(endpoint), "a+")  # noqa: SIM115 - held for the broker's life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise LockHeld(f"another broker already serves {endpoint}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n{code_fingerprint()}\n")
    handle.flush()
    return handle


SERVING = "serving"


def mark_serving(handle: IO[str]) -> None:
    """Say in the lock file that the broker's sockets are bound: a client may connect now."""
    handle.write(f"{SERVING}\n")
    handle.flush()


def serving(endpoint: str) -> bool:
    """True once the lock's holder has bound its sockets (:func:`mark_serving`)."""
    if not held(endpoint):
        return False
    try:
        lines = paths.lock_path(endpoint).read_text().split()
    except OSError:
        return False
    return len(lines) >= 3 and lines[2] == SERVING


def held(endpoint: str) -> bool:
    """True if a process on this node holds ``endpoint``'s lock (no message needed)."""
    try:
        handle = open(paths.lock_path(endpoint))  # noqa: SIM115
    except FileNotFoundError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def read_owner(endpoint: str) -> Owner:
    """The pid and code the serving broker wrote (None for what is missing or unreadable)."""
    try:
        lines = paths.lock_path(endpoint).read_text().split()
    except OSError:
        return Owner(None, None)
    pid = int(lines[0]) if lines and lines[0].isdigit() else None
    return Owner(pid, lines[1] if len(lines) >= 2 else None)


def names_this_code(endpoint: str) -> bool:
    """True unless the serving broker's lock file names other code than this process's."""
    code = read_owner(endpoint).code
    return code is None or code == code_fingerprint()
