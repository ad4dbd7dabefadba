"""The records messages carry: a pool spec, a rank's result, a task's verdict, outcomes.

A shared leaf beside :mod:`cpq.protocol` (which re-exports every name here): the broker, the
ranks and the clients all build and read these, and the protocol's decoder checks them field
by field (an :data:`Outcome` outside :data:`OUTCOMES` is malformed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from cpq import environ

#: A verdict's or a rank's outcome. The decoder refuses any other value (fail closed:
#: an outcome cpq does not know is malformed, never a pass; docs/design.md "Task outcome").
Outcome = Literal["passed", "failed", "skipped", "error"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)

#: Why the broker ended a task, where a client acts on it (``TaskResult.cause``, feature
#: ``verdict-cause``): "" nothing a client treats apart; "deadline": the task's deadline
#: passed (pytest-timeout's message then, ``cpq.client.timeouts``). The client reads this
#: field, never the verdict's words. A value the decoder does not know is malformed (fail
#: closed): a new value is a new feature, never sent to a peer that does not list it.
Cause = Literal["", "deadline"]
#: What a rank that refused a task found changed (``RankDone.stale_kind``, feature
#: ``refusal-kind``): "code" (``stale`` is a file it loaded) or "variable" (``stale`` is
#: the name of a variable an import read); "" from a rank that does not say (an older cpq).
StaleKind = Literal["", "code", "variable", "state"]


@dataclass(frozen=True)
class PoolSpec:
    """What makes two tasks able to share a warm group (docs/design.md, "Pool spec").

    ``backend`` is empty when the client lets the broker choose (nccl with GPUs, gloo without).
    ``env`` is a sorted list of ``[name, value]`` pairs so that equal specs encode equally.
    """

    world_size: int
    python: str
    roots: list[str]
    env: list[list[str]] = field(default_factory=list)
    backend: str = ""

    def __post_init__(self) -> None:
        """Refuse a spec no process could be started with (it must not reach ``Popen``)."""
        texts = [self.python, self.backend, *self.roots]
        for pair in self.env:
            if len(pair) != 2 or not (isinstance(pair[0], str) and isinstance(pair[1], str)):
                raise ValueError(f"env must hold [name, value] string pairs, got {pair!r}")
            if not pair[0] or "=" in pair[0]:
                raise ValueError(f"env name {pair[0]!r} is not a valid variable name")
            texts += pair
        # one scan of the strings (each task's spec is checked on the broker's hot path)
        if "\x00" in "".join(t for t in texts if isinstance(t, str)):
            raise ValueError("the pool spec (python, roots or env) contains a NUL byte")

    def key(self) -> tuple[Any, ...]:
        # Specs are dict keys on the broker's hot path; the key is computed once.
        cached = self.__dict__.get("_key")
        if cached is None:
            cached = (
                self.world_size,
                self.backend,
                self.python,
                tuple(self.roots),
                tuple(tuple(p) for p in self.env),
            )
            object.__setattr__(self, "_key", cached)
        return cached

    def __hash__(self) -> int:
        # Hashed dozens of times a task (queues, pools, placement's snapshot): a tuple does
        # not keep its hash, so the spec does.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(self.key())
            object.__setattr__(self, "_hash", cached)
        return cached

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, PoolSpec) and self.key() == other.key())

    def label(self) -> str:
        """A short human name: ``ws2/gloo`` plus the task variables a caller pinned (say
        ``NVTE_FLASH_ATTN=0``), for tables and logs. The caller's start variables (paths,
        thread counts) would drown it: :meth:`digest` tells specs with equal labels apart."""
        extra = "".join(f" {k}={v}" for k, v in self.env if not environ.is_start_var(k))
        return f"ws{self.world_size}/{self.backend or 'auto'}{extra}"

    def digest(self) -> str:
        """Six hex digits naming the whole spec (interpreter, roots, every variable)."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            cached = hashlib.sha256(repr(self.key()).encode()).hexdigest()[:6]
            object.__setattr__(self, "_digest", cached)
        return cached


@dataclass
class RankError:
    type: str
    message: str
    traceback: str = ""


@dataclass
class RankResult:
    """What one rank reports for one task."""

    rank: int
    outcome: Outcome
    error: RankError | None = None
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    peak_rss_mb: float = 0.0
    peak_cuda_mb: float = 0.0
    value: Any = None
    #: A failure as pytest prints it (its ``>`` and ``E`` lines), rendered in the rank where
    #: the frames are; "" where the rank runs no pytest (``error.traceback`` then).
    report: str = ""
    #: A test run through pytest in the rank (``cpq.rank.items``): pytest's own serialised
    #: reports of its phases, as pytest-xdist's workers send them (feature ``rank-pytest``).
    reports: list[dict[str, Any]] = field(default_factory=list)
    #: The warnings that test raised in this rank (message, category, filename, lineno).
    warnings: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TaskResult:
    """The broker's verdict on one task: the aggregate of every rank's report."""

    task_id: str
    outcome: Outcome
    ranks: list[RankResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    message: str = ""
    group_id: str = ""
    attempts: int = 1
    duration_s: float = 0.0
    queue_s: float = 0.0
    deadline_s: float = 0.0
    #: Every group an attempt ran on (a retried task ran on two), for session summaries.
    groups: list[str] = field(default_factory=list)
    #: Seconds the task's last attempt waited for its group to start, measured by the broker
    #: (feature ``spawn-wait``): the group's ready time minus the attempt's queue time, 0
    #: when a warm group took it; None when no group ran it or the broker did not measure.
    spawn_wait_s: float | None = None
    #: The rank whose failing frame waits for the client's debugger (-1: none; feature
    #: ``pdb-relay``, see :class:`DebugAttach`).
    debug_rank: int = -1
    #: Each rank's coverage data (see :attr:`RankDone.coverage`), for the client to merge.
    coverage: list[bytes] = field(default_factory=list)
    #: Where a deadline found a test pytest ran in the ranks: the phase (setup, call,
    #: teardown) of the lowest rank that was in one; "" otherwise (feature ``rank-pytest``).
    phase: str = ""
    #: Why the broker ended it, where a client acts on it (:data:`Cause`).
    cause: Cause = ""
    #: The attempt that gave this verdict ran its group's first task: a group that served
    #: no task before, as fresh as a new process (feature ``fresh-group``).
    on_fresh_group: bool = False

    @property
    def value(self) -> Any:
        """Rank 0's return value."""
        for rank in self.ranks:
            if rank.rank == 0:
                return rank.value
        return None

    @property
    def failed_ranks(self) -> list[RankResult]:
        return [r for r in self.ranks if r.outcome in ("failed", "error")]
