"""The process-wide state imports may touch, taken before a warm-up imports ahead
(:mod:`cpq.rank.ahead`): what it can put back, and what it says cannot be."""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

from cpq.rank import carryover, probes, reset, warnfilters


@dataclass
class Saved:
    """The process-wide state imports may touch, taken before them."""

    path: list[str]
    cwd: str
    environ: dict[str, str]
    filters: list[Any]
    switches: dict[str, Any]
    hooks: dict[str, Any]
    thread_hook: Any
    signals: dict[int, Any]
    threads: set[threading.Thread]
    root_logger: tuple[int, list[Any]]
    cuda: bool

    @classmethod
    def take(cls) -> Saved:
        return cls(
            path=list(sys.path),
            cwd=os.getcwd(),
            environ=dict(os.environ),
            filters=list(warnings.filters),
            switches=carryover.read_switches(),
            hooks=probes.sys_hooks(),
            thread_hook=threading.excepthook,
            signals=probes.signal_handlers(),
            threads=set(threading.enumerate()),
            root_logger=(logging.root.level, list(logging.root.handlers)),
            cuda=probes.cuda_initialised(),
        )

    def changed(self, path: list[str], environ: dict[str, str], kept: Any) -> str:
        """What the imports did that cannot be put back ("" when nothing); ``kept``: what
        they did that whoever goes on from here replays."""
        if sys.path != path + [e for e in kept.path if e not in path]:
            return "changed sys.path"
        if dict(os.environ) != {**environ, **kept.environ}:
            return "changed os.environ"
        if probes.sys_hooks() != self.hooks or threading.excepthook is not self.thread_hook:
            return "replaced a sys hook"
        if probes.signal_handlers() != self.signals:
            return "installed a signal handler"
        if set(threading.enumerate()) - self.threads:
            return "started a thread"
        if (logging.root.level, list(logging.root.handlers)) != self.root_logger:
            return "configured the root logger"
        if probes.cuda_initialised() and not self.cuda:
            return "initialised CUDA"
        return ""

    def put_back(self) -> None:
        sys.path[:] = self.path
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        reset.set_environ(self.environ)
        warnfilters.put(self.filters)
        now = carryover.read_switches()
        carryover.put_switches({n: v for n, v in self.switches.items() if now.get(n) != v})
