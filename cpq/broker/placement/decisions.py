"""What a placement decides; :mod:`cpq.broker.placing` carries each out, in order."""

from __future__ import annotations

from dataclasses import dataclass

from cpq.protocol import PoolSpec


@dataclass(frozen=True)
class Run:
    """Give the queue's next task of ``spec`` (``task``, a :meth:`Task.key`) to ``group``."""

    spec: PoolSpec
    task: str
    group: str


@dataclass(frozen=True)
class Start:
    """Start a group of ``spec`` on ``gpus`` (leased all or nothing when carried out).

    ``ref`` names it inside one placement (a later decision of the same placement may not
    refer to it: it has no id before it starts). ``since``: wall clock, when the oldest task
    it is for was queued (None: no task waits for it, a spare or a warm-up). ``for_task``:
    the key of the task it is started for, which alone may take it (``fresh_group``)."""

    spec: PoolSpec
    gpus: tuple[str, ...]
    spare: bool
    why: str
    since: float | None = None
    ref: str = ""
    for_task: str = ""


@dataclass(frozen=True)
class Stop:
    """Stop ``group``: ``why`` in words for the log, ``cpq-status`` and the timeline;
    ``cause`` is the timeline's word for it (``view.CAUSES``; yields are :class:`Yield`)."""

    group: str
    why: str
    cause: str


@dataclass(frozen=True)
class Yield:
    """Stop idle ``group`` at once (no grace: it runs no user code) so that another
    broker's older want gets its GPUs; the timeline counts it as an eviction."""

    group: str
    why: str


@dataclass(frozen=True)
class WantGpus:
    """A task of ``spec`` waits for GPUs other brokers hold: ``need`` more of ``gpus``
    (ids), waiting since ``since`` (wall clock). Published for them (:mod:`sharing`)."""

    spec: PoolSpec
    since: float
    need: int
    gpus: frozenset[str]


Decision = Run | Start | Stop | Yield | WantGpus
