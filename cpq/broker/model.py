"""The broker's state as plain data: clients, tasks, groups and their ranks, the totals.

No behaviour beyond small derived values: :mod:`cpq.broker.pools` changes groups and ranks,
:mod:`cpq.broker.tasks` changes tasks, :mod:`cpq.broker.loop` clients. Timestamps are
passed in from the broker's :class:`~cpq.broker.clock.Clock` (no field reads a clock).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Protocol

from cpq import protocol
from cpq.broker.liveness import BusyWatch
from cpq.osutil import pid_namespace
from cpq.protocol import PoolSpec, RankResult

# Which clients' processes this broker can look at (see Client.local_pid).
_HOST, _PIDNS = socket.gethostname(), pid_namespace()


class GroupProcess(Protocol):
    """What the broker needs of a group's process tree (:mod:`cpq.broker.supervisor`)."""

    group_id: str
    token: str
    gpus: list[str]
    rank_pids: set[int]
    #: Lease descriptors its processes inherit (:mod:`cpq.broker.leases`).
    lease_fds: list[int]
    #: This node has GPUs the broker assigns: a group given none of them is kept off them
    #: (``CUDA_VISIBLE_DEVICES=""``); on a node without any, its ranks see the caller's value.
    node_gpus: bool

    @property
    def pid(self) -> int | None: ...

    def start(self) -> None: ...

    def exit_code(self) -> int | None: ...

    def log_tail(self, max_bytes: int = 4000) -> str: ...

    def terminate(self, kill_at: float) -> None: ...

    def reap(self, now: float) -> bool: ...


NO_ENV: Any = object()  # a group's ranks have been sent no task variables yet


@dataclass
class Client:
    identity: bytes
    info: dict[str, Any] = field(default_factory=dict)
    last_seen: float = 0.0
    connected_at: float = 0.0  # wall clock
    in_flight: set[str] = field(default_factory=set)
    submitted: int = 0
    #: Said hello. Only greeted clients get heartbeats: a client the broker dropped (silent
    #: too long) or never knew (it outlived a broker restart) hears nothing, so it reports
    #: BrokerUnavailable instead of waiting forever for tasks this broker does not have.
    greeted: bool = False
    busy_watch: BusyWatch = field(default_factory=BusyWatch)
    #: The task variables of its last submit: what a submit with ``env_same`` means (None:
    #: unknown; a client that can say ``env_same`` always sends a map, if empty).
    last_env: dict[str, str] | None = None
    #: Who it is and which pytest session it serves, for the timeline (set by its hello).
    timeline_name: str = ""
    session: str = ""

    def local_pid(self) -> int | None:
        """The client's pid if this broker can look at its process: same host and same pid
        namespace (a client in another container has its own pids)."""
        pid = self.info.get("pid")
        same_node = self.info.get("host") == _HOST
        same_pids = self.info.get("pidns") is not None and self.info["pidns"] == _PIDNS
        return pid if same_node and same_pids and isinstance(pid, int) and pid > 0 else None

    def label(self) -> str:
        return f"client {self.info.get('name') or self.identity.hex()}"

    def features(self) -> frozenset[str]:
        """The optional protocol features this client said it reads (none: an old one)."""
        listed = self.info.get("features")
        if not isinstance(listed, list):
            return frozenset()
        return frozenset(f for f in listed if isinstance(f, str))


@dataclass
class Task:
    client: bytes
    submit: protocol.Submit
    spec: PoolSpec
    timeout_s: float
    queued_at: float = 0.0
    attempts: int = 1
    notes: list[str] = field(default_factory=list)
    group: Group | None = None
    started_at: float = 0.0
    deadline: float = 0.0
    #: Ranks that began the test's own protocol (a first ``RankBegun``): the deadline is
    #: the test's from the first; and ranks whose protocol ended (a second: the session's
    #: finish follows, untimed like a fresh run's, within the start allowance).
    begun_ranks: set[int] = field(default_factory=set)
    ended_ranks: set[int] = field(default_factory=set)
    results: dict[int, RankResult] = field(default_factory=dict)
    grace_until: float | None = None
    # Stack collection (after a deadline or a peer's failure): why, until when, what came back.
    stacks_reason: str = ""
    stacks_until: float | None = None
    stacks: dict[int, str] = field(default_factory=dict)
    #: Per rank, the test phase its stack was in (``RankStacks.phase``).
    stack_phases: dict[int, str] = field(default_factory=dict)
    #: What each rank asked for its stack had printed so far (stdout, stderr).
    stack_output: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: Where the last deadline found the test (``TaskResult.phase``), kept past the stacks.
    hung_phase: str = ""
    orphaned: bool = False
    first_queued_at: float = 0.0
    # The deadline the client asked for; with --adaptive-timeout, ``timeout_s`` may be a
    # learned one instead, and ``deadline_note`` says how it was learned.
    requested_timeout_s: float = 0.0
    deadline_note: str = ""
    last_group_id: str = ""  # survives a retry's reset of ``group``, for the timing history
    groups: list[str] = field(default_factory=list)  # every group an attempt ran on
    #: Cancelled while running (its client went away): the ranks were asked to stop; the
    #: group is recycled if they have not all reported by then.
    cancel_until: float | None = None
    #: When the client was last told why the task still waits (0: never).
    waiting_said_at: float = 0.0
    pg_seqs: dict[int, int] = field(default_factory=dict)  # rank -> collectives done
    stale_bounces: int = 0  # fresh groups that found the task's code changed
    #: Seconds the attempt that ran waited for its group to start (see
    #: :meth:`cpq.broker.tasks.Tasks.start`); None until a group takes it.
    spawn_wait_s: float | None = None
    #: Attempt 1's infra failure: (reason, detail), shown once in the verdict.
    first_failure: tuple[str, str] = ("", "")
    #: For the timeline: wall clock when this attempt was queued and started (0: not yet),
    #: whether it was its group's first task, and the client and session it came from.
    queued_wall: float = 0.0
    started_wall: float = 0.0
    first_on_group: bool = False
    client_name: str = ""
    session: str = ""
    #: The rank whose failing frame waits for the client's debugger (``pytest --pdb``).
    debug_rank: int = -1
    coverage: dict[int, bytes] = field(default_factory=dict)  # rank -> its coverage data

    @property
    def key(self) -> str:
        return task_key(self.client, self.submit.task_id)


def session_of(task: Task) -> str:
    """The test session a task belongs to: what it says, else its client."""
    return task.submit.session or task.client.hex()


def task_key(client: bytes, task_id: str) -> str:
    return f"{client.hex()}:{task_id}"


@dataclass
class Rank:
    identity: bytes
    rank: int
    pid: int
    last_seen: float = 0.0
    ready: bool = False
    busy_watch: BusyWatch = field(default_factory=BusyWatch)


@dataclass
class Group:
    id: str
    spec: PoolSpec
    process: GroupProcess
    state: str = "starting"  # starting | idle | busy | stopping
    ranks: dict[int, Rank] = field(default_factory=dict)
    task: Task | None = None
    tasks_done: int = 0
    started_at: float = 0.0
    started_wall: float = 0.0
    ready_after_s: float | None = None
    ready_at: float = 0.0
    last_used: float = 0.0
    rss_mb: dict[int, float] = field(default_factory=dict)
    stop_reason: str = ""
    rss_ready_mb: dict[int, float] = field(default_factory=dict)  # baseline for growth
    cuda_mb: dict[int, float] = field(default_factory=dict)
    cuda_reserved_mb: dict[int, float] = field(default_factory=dict)
    unfit: dict[int, str] = field(default_factory=dict)  # rank -> why it cannot go on
    #: Started as a spare (:mod:`cpq.broker.placement.spares`) and has taken no task yet.
    spare: bool = False
    #: Optional features every rank reads (from their ``rank_ready``).
    rank_features: frozenset[str] | None = None
    #: The task variables its ranks last got: a ``run`` with the same ones says
    #: ``env_same`` instead of sending them again (``NO_ENV``: none sent yet).
    last_env: Any = NO_ENV
    #: Variables its ranks' imports read (names only; ``cpq.rank.importenv``).
    bound_env: set[str] = field(default_factory=set)
    start_bound_env: set[str] = field(default_factory=set)  # of those, read at start-up
    #: The sessions it served (``Submit.session``, else the client's identity).
    sessions: set[str] = field(default_factory=set)
    #: Started for this task (a :attr:`Task.key` that asked for ``fresh_group``): no other
    #: task takes it first; "" once it took that task (then an ordinary group).
    reserved_for: str = ""

    @staticmethod
    def id_for(seq: int, broker_tag: str) -> str:
        """The id of this broker's ``seq``-th group: ``g3-9ix0k``, short in ``cpq-status``
        and never reused by another broker of the same history (see
        :func:`cpq.broker.config.broker_tag`); ``g3`` without a tag."""
        return f"g{seq}-{broker_tag}" if broker_tag else f"g{seq}"

    def note_ready(self, rank: Rank, message: protocol.RankReady) -> bool:
        """Record what a rank said when it became ready; True once every rank of the group
        has (the features all of them read, their memory at ready, what their imports read
        while the group started)."""
        rank.ready = True
        reads = frozenset(message.features)
        self.rank_features = reads if self.rank_features is None else self.rank_features & reads
        self.rss_ready_mb[rank.rank] = message.rss_mb
        self.bound_env.update(message.bound_env)
        self.start_bound_env.update(message.bound_env)
        self.rss_mb.setdefault(rank.rank, message.rss_mb)  # shown until its first task
        return len(self.ranks) == self.spec.world_size and all(r.ready for r in self.ranks.values())


@dataclass
class Totals:
    submitted: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    retries: int = 0
    rejected: int = 0
    groups_started: int = 0
    groups_failed: int = 0
    group_start_s: float = 0.0
    #: Undecodable frames, and messages on the wrong socket (a client's on the ranks').
    malformed: int = 0
    groups_recycled: int = 0
    timings_write_errors: int = 0
    busy_silences: int = 0  # ranks or clients silent past liveness but computing: not dead
