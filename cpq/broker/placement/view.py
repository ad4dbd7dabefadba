"""What placement sees: a snapshot of the broker, taken by :mod:`cpq.broker.placing`.

Plain frozen values (no sockets, no processes, no clock), so a placement is a pure function
of one and its tests are tables of snapshots (``tests/unit/test_placement.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from cpq import environ
from cpq.protocol import PoolSpec

#: What one CPU rank is assumed to hold before any group on this broker was measured (MB):
#: torch, cpq and pytest imported (BENCHMARKS.md, "One placement", has the measured figure).
DEFAULT_RANK_MB = 400.0

#: The placement's word for each reason a group stops (the timeline's ``cause``).
CAUSES = ("evicted", "spare-unused", "recycled")


@dataclass(frozen=True)
class Room:
    """The node as this broker may use it: GPUs, the CPU budget (cores for busy ranks,
    memory for live ones), and how specs map to backends."""

    gpus: tuple[str, ...] = ()
    max_ranks: int = 8
    memory_mb: float = 0.0
    oversubscribe: bool = False
    fake: bool = False
    #: GPUs of the node this broker may not lease, and why (found when it started).
    refused: Mapping[str, str] = field(default_factory=dict)

    def backend_for(self, spec: PoolSpec) -> str:
        # A node whose GPUs were all refused (unsafe lease files) still has GPUs: its GPU
        # tasks are rejected saying why, never run on the CPU instead.
        return spec.backend or ("nccl" if self.gpus or self.refused else "gloo")

    def uses_gpus(self, spec: PoolSpec) -> bool:
        return self.backend_for(spec) == "nccl"

    def dist_backend(self, spec: PoolSpec) -> str:
        """What the ranks run: the spec's backend, gloo on a fake inventory."""
        return "gloo" if self.fake and self.uses_gpus(spec) else self.backend_for(spec)

    def allowed_gpus(self, spec: PoolSpec) -> list[str]:
        """This node's GPUs that ``spec``'s caller may use: a ``CUDA_VISIBLE_DEVICES`` in
        the caller's environment narrows them (by physical id); it is never passed on."""
        wanted = environ.gpu_filter(dict(spec.env))
        return list(self.gpus) if wanted is None else [g for g in self.gpus if g in wanted]


@dataclass(frozen=True)
class GroupView:
    """One of the broker's groups, as placement sees it."""

    id: str
    spec: PoolSpec
    state: str  # starting | idle | busy | stopping
    gpus: tuple[str, ...] = ()
    spare: bool = False
    #: Counts against the CPU budget (a gloo group on this node's cores and memory).
    cpu: bool = True
    #: What it holds (MB, all ranks): measured, else its spec's estimate.
    memory_mb: float = 0.0
    last_used: float = 0.0
    ready_at: float = 0.0
    sessions: frozenset[str] = frozenset()
    tasks_done: int = 0
    #: rank -> why it cannot serve another task (``RankDone.unfit``).
    unfit: tuple[tuple[int, str], ...] = ()
    #: rank -> RSS grown since ready (MB), for ranks that reported a baseline.
    rss_growth_mb: tuple[tuple[int, float], ...] = ()
    #: Started for this queued task (its key; ``Submit.fresh_group``): no other takes it.
    reserved_for: str = ""

    @property
    def ranks(self) -> int:
        return self.spec.world_size


@dataclass(frozen=True)
class Queued:
    """A queued task, as placement sees it."""

    key: str
    client: bytes = b""
    session: str = ""
    affinity: str = ""
    #: Its last group found its code changed: a spare (which loaded none) serves it first.
    fresh: bool = False
    #: It asked for groups of its own session (``Submit.own_groups``).
    own_groups: bool = False
    #: It runs only on a group started for it (``Submit.fresh_group``).
    fresh_group: bool = False


@dataclass(frozen=True)
class QueueView:
    """The queued tasks of one spec: the first few in the order the queue hands them out."""

    spec: PoolSpec
    tasks: tuple[Queued, ...]
    depth: int
    oldest: float  # monotonic, when its oldest task was queued


@dataclass(frozen=True)
class Want:
    """Another broker's task waits for GPUs (read from its want file, :mod:`.yielding`)."""

    broker: str  # the waiting broker's id (unique per broker process)
    since: float  # when its oldest waiting task was queued (wall clock)
    need: int  # GPUs it still needs beyond what it can lock now
    gpus: frozenset[str]  # UUIDs it may use that it cannot lock now
    who: str = ""  # user@host pid N, for messages
    spec: str = ""

    def key(self) -> tuple[float, str]:
        return (self.since, self.broker)


class SpecHistory(Protocol):
    """What placement reads of the past (:class:`~cpq.broker.placement.history.History`)."""

    def recent(self, spec: PoolSpec, now: float, window_s: float = ...) -> bool: ...

    def wanted_spares(self, now: float, window_s: float) -> list[PoolSpec]: ...

    def spawn_cost(self, spec: PoolSpec, now: float, window_s: float) -> float: ...

    def memory_need(self, spec: PoolSpec) -> float: ...

    def group_for(self, spec: PoolSpec, key: str) -> str: ...


@dataclass(frozen=True)
class Bounds:
    """The operator's settings placement applies (``cpq-broker --help``)."""

    spares: int = 1
    spare_window_s: float = 600.0
    scale_up_after_s: float = 1.0
    max_tasks_per_group: int = 0
    max_rss_growth_mb: float = 0.0
    #: An idle used group beyond its spec's most recently used one is released after this
    #: long unused (0: never; ``--idle-release``).
    idle_release_s: float = 900.0


@dataclass(frozen=True)
class Snapshot:
    """Everything one placement decides from."""

    now: float  # monotonic
    wall: float  # wall clock (wants are compared between brokers)
    room: Room
    groups: tuple[GroupView, ...]
    queues: tuple[QueueView, ...]  # the longest waiting first
    history: SpecHistory
    bounds: Bounds = Bounds()
    #: GPUs another broker held when this broker last tried to lease them (just now).
    held_elsewhere: frozenset[str] = frozenset()
    #: Other brokers' fresh wants, oldest first, and GPU id -> UUID (wants name UUIDs).
    foreign: tuple[Want, ...] = ()
    uuids: Mapping[str, str] = field(default_factory=dict)
    me: str = ""
    #: No group may start for future tasks (draining or stopping): spares, warming.
    closing: bool = False
    #: Groups asked for ahead of tasks (``--warm``, the plugin's warm-up): (spec, count).
    warm: tuple[tuple[PoolSpec, int], ...] = ()
