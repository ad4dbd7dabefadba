"""Admission, the placement's gate: a task that can never run is refused at submit, never
queued forever (so no later step ever sees it).

A target that is not ``module:function``, a deadline that would never fire, a spec this
node cannot hold (a world size above its GPUs or ``--max-ranks``, an unknown backend, a
``CUDA_VISIBLE_DEVICES`` that leaves too few GPUs) or an interpreter that is not there:
each gets a one-line reason, sent back as the task's ``error`` verdict at once.
"""

from __future__ import annotations

import math
import os

from cpq import environ, protocol
from cpq.broker.placement.view import Room
from cpq.protocol import PoolSpec

#: Infra retries one task may ask for: each costs a deadline and a fresh group.
MAX_RETRIES = 5


class Admission:
    """Why a submitted task must be refused ("" when it may queue)."""

    def __init__(self, room: Room) -> None:
        self.room = room
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
        impossible_ = impossible(message.spec, self.room)
        if impossible_:
            return impossible_
        python = message.spec.python
        if python not in self._interpreters:  # a syscall per new interpreter, not per task
            # The ids (and capabilities) exec will use: a broker under another user may run
            # with CAP_DAC_READ_SEARCH to read an interpreter in a home it cannot enter.
            runnable = os.access(python, os.X_OK, effective_ids=True)
            if not (os.path.isabs(python) and runnable):
                return f"interpreter {python!r} is not an executable on this node"
            self._interpreters.add(python)  # one removed later fails its group's start
        return ""


def impossible(spec: PoolSpec, room: Room) -> str | None:
    """Why ``spec`` can never run on this node (and how to make room for it), or None."""
    ws = spec.world_size
    if ws < 1:
        return f"world_size must be at least 1, got {ws}"
    backend = room.backend_for(spec)
    if backend not in ("gloo", "nccl", "mpi", "ucc"):
        return f"unknown torch.distributed backend {spec.backend!r}"
    refused = "; ".join(room.refused.values())
    why_refused = f" (refused: {refused})" if refused else ""
    if not room.uses_gpus(spec):
        if ws > room.max_ranks:
            return (
                f"world_size {ws} exceeds this broker's --max-ranks {room.max_ranks} for CPU "
                f"groups; {_raise(f'--max-ranks {ws}')}"
            )
        return None
    if not room.gpus:
        return f"backend {backend!r} needs GPUs and this broker owns none{why_refused}"
    if ws > len(room.gpus) and not room.oversubscribe:
        return (
            f"world_size {ws} needs {ws} GPUs but this broker owns {len(room.gpus)} "
            f"({','.join(room.gpus)}); {_raise('--oversubscribe')} to share GPUs" + why_refused
        )
    allowed = room.allowed_gpus(spec)
    if len(allowed) < ws and not (allowed and room.oversubscribe):
        visible = dict(spec.env).get(environ.GPU_VAR)
        return (
            f"world_size {ws} needs {ws} GPUs but your CUDA_VISIBLE_DEVICES={visible!r} "
            f"allows {len(allowed)} of this broker's GPUs ({','.join(room.gpus)})"
        )
    return None


def _raise(option: str) -> str:
    """How to give a broker more room, started by hand or by the plugin."""
    return (
        f"start the broker with {option} (a broker the plugin starts: `cpq stop`, then "
        f"CPQ_BROKER_ARGS='{option}' where the next session runs)"
    )
