"""``CPQ_RANK_PROFILE=DIR``: a tool for finding what a task costs a rank beyond the test's own
time (BENCHMARKS.md)."""

from __future__ import annotations

import contextlib
import os
from typing import Any


class TaskProfile:
    """``CPQ_RANK_PROFILE=DIR``: each task's handling in this rank under ``cProfile`` (from
    the task's arrival to its report's encoding), the stats written to
    ``DIR/rank<r>-<pid>-<n>.prof``, one file per 25 tasks. A tool for finding what a task costs the
    rank beyond the test's own time (BENCHMARKS.md); off, it costs one attribute test."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tasks = 0
        self.profiler: Any = None
        if path:
            import cProfile

            self.profiler = cProfile.Profile()

    @classmethod
    def from_env(cls, rank: int) -> TaskProfile:
        folder = os.environ.get("CPQ_RANK_PROFILE", "")
        return cls(os.path.join(folder, f"rank{rank}-{os.getpid()}") if folder else "")

    def begin(self) -> None:
        if self.profiler is not None:
            self.profiler.enable()

    def end(self) -> None:
        if self.profiler is None:
            return
        self.profiler.disable()
        self.tasks += 1
        if self.tasks % 25 == 0:  # then a new profile: a file per 25 tasks, numbered
            with contextlib.suppress(OSError):
                self.profiler.dump_stats(f"{self.path}-{self.tasks // 25:04d}.prof")
            self.profiler = type(self.profiler)()
