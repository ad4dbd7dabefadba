"""A probe pytest plugin: the wall-clock time of pytest's main hooks in every pytest process
(the calling process, the warm caller's fork, each rank's session, a fresh run's rank),
appended to ``$HOOKTIME_LOG`` (default ``/tmp/ht.log``) with the process's pid, parent pid
and creation time. Used for "Where a warm session's 22.5 s went" (BENCHMARKS.md).

Usage: copy it onto the import path of every process (the device host: ``/tmp/site``,
which ``.megatron/run.sh`` puts first), then ``PYTEST_ADDOPTS="-p hooktime"`` for the runs
to compare (a constant variable: groups and warm callers are not refused for it).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any

_LOG = os.environ.get("HOOKTIME_LOG", "/tmp/ht.log")


def _log(what: str) -> None:
    with open(_LOG, "a") as handle:
        handle.write(f"{time.time():.3f} pid={os.getpid()} ppid={os.getppid()} {what}\n")


try:
    import psutil

    _log(
        f"plugin imported; process created {psutil.Process().create_time():.3f} "
        f"argv={' '.join(sys.argv)[:80]}"
    )
except Exception:
    _log("plugin imported")
atexit.register(lambda: _log("atexit"))
_first: list[int] = []


def pytest_configure(config: Any) -> None:
    _log("configure")


def pytest_sessionstart(session: Any) -> None:
    _log("sessionstart")


def pytest_collection_finish(session: Any) -> None:
    _log(f"collection_finish {len(session.items)}")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    if not _first:
        _first.append(1)
        _log("first test start")


def pytest_sessionfinish(session: Any) -> None:
    _log("sessionfinish")


def pytest_unconfigure(config: Any) -> None:
    _log("unconfigure")
