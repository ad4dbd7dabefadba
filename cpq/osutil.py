"""Small Linux process helpers used on both sides of a group (agent launcher and ranks)."""

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
