"""Admission: a task that can never run is refused at submit, never queued forever.

A target that is not ``module:function``, a deadline that would never fire, a spec this
node cannot hold (a world size above its GPUs or ``--max-ranks``, an unknown backend, a
``CUDA_VISIBLE_DEVICES`` that leaves too few GPUs) or an interpreter that is not there:
each gets a one-line reason, sent back as the task's ``error`` verdict at once.
"""

from __future__ import annotations

import math
import os

from cpq import protocol
from cpq.broker.scheduler import Resources

#: Infra retries one task may ask for: each costs a deadline and a fresh group.
MAX_RETRIES = 5


class Admission:
    """Why a submitted task must be refused ("" when it may queue)."""

    def __init__(self, resources: Resources) -> None:
        self.resources = resources
        self._interpreters: set[str] = set()  # interpreters seen to be executable

    def reject_reason(self, message: protocol.Submit, draining: bool) -> str:
        if draining:
            return "the broker is draining and accepts no new tasks"
        module, sep, attr = message.target.partition(":")
        if not sep or not module or not attr:
            return f"target {message.target!r} must look like 'package.module:function'"
        if message.timeout is not None and not 0 < message.timeout < math.inf:
            # NaN and inf too: a deadline that never fires lets one hung test hold a group
            # (and its GPUs) for good; heartbeats only catch dead ranks, not stuck ones.
            return f"timeout must be a positive, finite number of seconds, got {message.timeout}"
        if not 0 <= message.retries <= MAX_RETRIES:
            return f"retries must be between 0 and {MAX_RETRIES}, got {message.retries}"
        impossible = self.resources.impossible(message.spec)
        if impossible:
            return impossible
        python = message.spec.python
        if python not in self._interpreters:  # a syscall per new interpreter, not per task
            # The ids (and capabilities) exec will use: a broker under another user may run
            # with CAP_DAC_READ_SEARCH to read an interpreter in a home it cannot enter.
            runnable = os.access(python, os.X_OK, effective_ids=True)
            if not (os.path.isabs(python) and runnable):
                return f"interpreter {python!r} is not an executable on this node"
            self._interpreters.add(python)  # one removed later fails its group's start
        return ""
