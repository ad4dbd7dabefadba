"""What an import may change in the process that cpq compares before and after it: the
``sys`` hooks, the signal handlers, CUDA (docs/design.md, "Imports ahead of a session" and
"The warm caller"). One definition for the rank's boundary, its imports ahead and the warm
caller's blame, which must agree on what "changed" means."""

from __future__ import annotations

import signal
import sys
from typing import Any

#: The ``sys`` hooks an import may replace.
HOOKS = ("excepthook", "displayhook", "unraisablehook", "breakpointhook")

#: Every signal a handler may be set for (SIGKILL and SIGSTOP take none); listed once,
#: since the warm caller's blame looks twice at every module a pass loads.
SIGNALS = [int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


def sys_hooks() -> dict[str, Any]:
    return {name: getattr(sys, name) for name in HOOKS if hasattr(sys, name)}


def signal_handlers() -> dict[int, Any]:
    return {number: signal.getsignal(number) for number in SIGNALS}


def cuda_initialised() -> bool:
    """torch's CUDA initialised in this process (False without torch)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # a torch being torn down, or a stand-in without cuda
        return False
