"""Small Linux process helpers shared by every cpq process (client, broker, rank).

Imports nothing else of cpq."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` when the parent dies; exit now if it already has.

    This is what keeps a SIGKILLed broker from leaving GPU processes behind: the torchrun
    agent dies with the broker and every rank dies with its agent, with no cooperation
    needed from a process that may be hung.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(75)


def pid_namespace() -> int | None:
    """This process's pid namespace (an inode number): a pid means the same process to two
    processes only if they share it, as a broker and a client in one container do."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def available_memory_mb() -> float:
    """``MemAvailable`` of ``/proc/meminfo`` in MB (0 where it cannot be read: not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def broker_command(*args: str) -> list[str]:
    """``python -m cpq.broker ARGS`` with this interpreter. Without the working directory on
    the import path where the interpreter allows it (``-P``, Python 3.11+): started from a
    folder that holds a ``cpq`` folder (the parent of a clone), ``-m`` would import that
    one instead of the installed package. A rank keeps it (``torchrun -m pytest`` does)."""
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe, "-m", "cpq.broker", *args]
