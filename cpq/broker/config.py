"""``BrokerConfig``: everything ``cpq-broker``'s command line sets (see ``cpq-broker --help``),
and the tag that names this broker's groups."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from cpq.protocol import PoolSpec
from cpq.timings import DEFAULT_MAX_BYTES

_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _base36(n: int) -> str:
    out = ""
    while True:
        n, digit = divmod(n, 36)
        out = _DIGITS[digit] + out
        if not n:
            return out


def broker_tag(pid: int | None = None, started_s: float | None = None) -> str:
    """What tells this broker's groups from every other broker's of one history: its pid
    and its start second (modulo 36², about 21 minutes), in base 36, the second in the last
    two digits (``9ix0k``). Group ids are ``g<n>-<tag>`` (:meth:`~cpq.broker.model.Group.id_for`):
    a broker restarted on the same state directory numbers its groups from 1 again, and
    the timeline, the logs (``group-<id>-*.log``) and ``cpq-status`` must not mistake its
    ``g1`` for the killed broker's. Two brokers of one host share a tag only with the same
    pid (reused only after the first one exited) started in the same second of the cycle."""
    pid = os.getpid() if pid is None else pid
    second = int(time.time() if started_s is None else started_s) % 36**2
    return _base36(pid) + _base36(second).rjust(2, "0")


@dataclass
class BrokerConfig:
    endpoint: str
    state_dir: Path
    log_dir: Path
    gpus: list[str] = field(default_factory=list)
    #: GPU id -> UUID, the name of its node-wide lease (:mod:`cpq.broker.inventory`).
    gpu_uuids: dict[str, str] = field(default_factory=dict)
    #: ``--gpus fake:N``: GPUs placed and leased as real ones, ranks run gloo.
    fake_gpus: bool = False
    #: The node-shared lease directory (``--gpu-leases``). None: no leases, for in-process
    #: unit tests only; ``cpq-broker`` always leases.
    gpu_leases: Path | None = None
    #: Ranks of CPU groups that run tasks at once (``--max-ranks``: cores).
    max_ranks: int = 8
    oversubscribe: bool = False
    heartbeat_s: float = 1.0
    liveness: int = 5
    idle_exit_s: float = 0.0
    start_timeout_s: float = 300.0
    failure_grace_s: float = 3.0
    #: A cancelled task's ranks have this long to stop before its group is recycled.
    cancel_grace_s: float = 3.0
    #: A task queued this long hears why it waits (and again every as long after).
    waiting_notice_s: float = 3.0
    stack_wait_s: float = 2.0
    kill_grace_s: float = 3.0
    max_tasks_per_group: int = 0
    default_timeout_s: float = 90.0
    insecure: bool = False
    scale_up_after_s: float = 1.0
    #: Finished tasks are appended here, one JSON line each (None: keep no history).
    timings_file: Path | None = None
    timings_max_bytes: int = DEFAULT_MAX_BYTES
    #: Learned deadlines: max(floor, k x the slowest passing run) for tasks with history.
    adaptive_timeout: bool = False
    adaptive_k: float = 3.0
    adaptive_floor_s: float = 30.0
    #: Recycle a group after a task once a rank's RSS grew this much since ready (0: never).
    max_rss_growth_mb: float = 0.0
    #: Idle groups beyond each spec's most recently used one go after this long (0: never).
    idle_release_s: float = 900.0
    #: Clean spare groups kept per recently used spec (``--spares``, 0 or 1; see
    #: :mod:`cpq.broker.placement.spares`), and how recently a spec must have run a task to
    #: keep one.
    spares: int = 1
    spare_window_s: float = 600.0
    #: Memory (MB) CPU groups may hold while they live (``--memory``): an idle rank costs
    #: memory, a busy one a core (``max_ranks``). docs/design.md, "Placement".
    memory_mb: float = 16_000.0
    #: Groups to start at start-up, as (spec, count) (``--warm``).
    warm: list[tuple[PoolSpec, int]] = field(default_factory=list)
    #: Ends every group id of this broker (:func:`broker_tag`; "": plain ``g<n>``, for
    #: unit tests of one broker on fakes).
    broker_tag: str = field(default_factory=broker_tag)

    @property
    def silence_s(self) -> float:
        """A peer silent this long (and not computing) is dead."""
        return self.heartbeat_s * self.liveness
