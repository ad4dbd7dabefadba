"""Queues and resources: which task runs next, and where a new group may go (broker side).

Pure bookkeeping with no sockets and no processes, so the broker's event loop stays a
thin dispatcher and these rules can be read (and changed) in one place:

* one queue per pool spec, and inside it one FIFO per client served round-robin, so one
  client with a thousand queued tasks cannot starve another with one;
* GPUs are handed out as disjoint sets (unless ``oversubscribe``), each leased node-wide
  first (:mod:`cpq.broker.leases`: a GPU another broker holds is not free); CPU (gloo)
  groups are bounded by ``max_ranks`` (cores), except spares, which may also be held in
  ``spare_memory_mb`` beyond it (an idle rank costs memory, not a core; see
  :mod:`cpq.broker.spares`);
* a spec that can never run on this node is rejected up front, never queued.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from cpq import environ
from cpq.broker.leases import Attempt, Leases
from cpq.protocol import PoolSpec


class Queued(Protocol):
    spec: PoolSpec
    client: bytes
    queued_at: float


T = TypeVar("T", bound=Queued)


class FairQueue(Generic[T]):
    """Tasks of one spec: per-client FIFOs, served round-robin across clients."""

    def __init__(self) -> None:
        self._by_client: OrderedDict[bytes, deque[T]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_client.values())

    def __iter__(self) -> Iterator[T]:
        for fifo in self._by_client.values():
            yield from fifo

    def push(self, task: T, front: bool = False) -> None:
        fifo = self._by_client.setdefault(task.client, deque())
        if front:
            fifo.appendleft(task)
            self._by_client.move_to_end(task.client, last=False)
        else:
            fifo.append(task)

    def peek(self) -> T | None:
        """The task :meth:`pop` would return next (left queued)."""
        for fifo in self._by_client.values():
            return fifo[0]
        return None

    def pop(self) -> T | None:
        for client, fifo in self._by_client.items():
            task = fifo.popleft()
            if fifo:
                self._by_client.move_to_end(client)  # this client's turn is over
            else:
                del self._by_client[client]
            return task
        return None

    def remove(self, predicate: object) -> list[T]:
        removed: list[T] = []
        for client in list(self._by_client):
            fifo = self._by_client[client]
            keep = deque(t for t in fifo if not predicate(t))  # type: ignore[operator]
            removed.extend(t for t in fifo if predicate(t))  # type: ignore[operator]
            if keep:
                self._by_client[client] = keep
            else:
                del self._by_client[client]
        return removed

    def oldest(self) -> float:
        return min((t.queued_at for t in self), default=float("inf"))


class Queues(Generic[T]):
    def __init__(self) -> None:
        self.by_spec: dict[PoolSpec, FairQueue[T]] = {}

    def push(self, task: T, front: bool = False) -> None:
        self.by_spec.setdefault(task.spec, FairQueue()).push(task, front)

    def pop(self, spec: PoolSpec) -> T | None:
        queue = self.by_spec.get(spec)
        task = queue.pop() if queue else None
        if queue is not None and not queue:
            del self.by_spec[spec]
        return task

    def peek(self, spec: PoolSpec) -> T | None:
        queue = self.by_spec.get(spec)
        return queue.peek() if queue else None

    def depth(self, spec: PoolSpec) -> int:
        queue = self.by_spec.get(spec)
        return len(queue) if queue else 0

    def waiting_specs(self) -> list[PoolSpec]:
        """Specs with queued tasks, the one waiting longest first."""
        return sorted(self.by_spec, key=lambda s: self.by_spec[s].oldest())

    def remove(self, predicate: object) -> list[T]:
        removed: list[T] = []
        for spec in list(self.by_spec):
            removed.extend(self.by_spec[spec].remove(predicate))
            if not self.by_spec[spec]:
                del self.by_spec[spec]
        return removed

    def __iter__(self) -> Iterator[T]:
        for queue in self.by_spec.values():
            yield from queue

    def __len__(self) -> int:
        return sum(len(q) for q in self.by_spec.values())


class Resources:
    """The node's GPUs and CPU rank slots, and who holds which."""

    def __init__(
        self,
        gpus: list[str],
        max_ranks: int,
        oversubscribe: bool = False,
        leases: Leases | None = None,
        fake: bool = False,
        refused: dict[str, str] | None = None,
        spare_memory_mb: float = 0.0,
    ) -> None:
        self.gpus = list(gpus)
        self.max_ranks = max_ranks
        self.oversubscribe = oversubscribe
        self.leases = leases
        self.fake = fake  # --gpus fake:N: GPU placement, gloo ranks
        self.refused = refused or {}  # GPUs of the node this broker may not lease, and why
        self._gpu_users: dict[str, int] = {g: 0 for g in self.gpus}
        self.cpu_ranks_used = 0
        #: Memory CPU spares may hold beyond ``max_ranks``, and how much they hold (each
        #: such spare reserves its spec's measured ready RSS).
        self.spare_memory_mb = spare_memory_mb
        self.spare_memory_used_mb = 0.0

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

    def impossible(self, spec: PoolSpec) -> str | None:
        """Why ``spec`` can never run on this node, or None."""
        ws = spec.world_size
        if ws < 1:
            return f"world_size must be at least 1, got {ws}"
        if self.backend_for(spec) not in ("gloo", "nccl", "mpi", "ucc"):
            return f"unknown torch.distributed backend {spec.backend!r}"
        if self.uses_gpus(spec):
            if not self.gpus:
                refused = "; ".join(self.refused.values())
                why = f" (refused: {refused})" if refused else ""
                backend = self.backend_for(spec)
                return f"backend {backend!r} needs GPUs and this broker owns none{why}"
            if ws > len(self.gpus) and not self.oversubscribe:
                refused = "; ".join(self.refused.values())
                return (
                    f"world_size {ws} needs {ws} GPUs but this broker owns {len(self.gpus)} "
                    f"({','.join(self.gpus)}); start it with --oversubscribe to share GPUs"
                    + (f" (refused: {refused})" if refused else "")
                )
            allowed = self.allowed_gpus(spec)
            if len(allowed) < ws and not (allowed and self.oversubscribe):
                visible = dict(spec.env).get(environ.GPU_VAR)
                return (
                    f"world_size {ws} needs {ws} GPUs but your CUDA_VISIBLE_DEVICES={visible!r} "
                    f"allows {len(allowed)} of this broker's GPUs ({','.join(self.gpus)})"
                )
        elif ws > self.max_ranks:
            return (
                f"world_size {ws} exceeds this broker's --max-ranks {self.max_ranks} for CPU groups"
            )
        return None

    def free_gpus(self) -> list[str]:
        return [g for g, users in self._gpu_users.items() if users == 0]

    def allocate(
        self, spec: PoolSpec, since: float = float("inf"), now: float = 0.0
    ) -> list[str] | None:
        """GPUs (empty for CPU groups) for a new group of ``spec``, or None if none fit now;
        ``since``: when the task it is for was queued (wall clock; a want of another broker
        older than that keeps its GPUs), ``now``: monotonic, for lease retries."""
        ws = spec.world_size
        if not self.uses_gpus(spec):
            if self.cpu_ranks_used + ws > self.max_ranks:
                return None
            self.cpu_ranks_used += ws
            return []
        allowed = self.allowed_gpus(spec)
        free = [g for g in self.free_gpus() if g in allowed]
        chosen = None
        if len(free) >= ws:
            chosen = self._lease(free, ws, since, now)
        elif self.leases is not None:  # our own groups hold the rest: nothing to want yet
            self.leases.last_attempt = Attempt(lockable=set(free))
        if chosen is None and self.oversubscribe:
            chosen = self._lease(sorted(allowed, key=lambda g: self._gpu_users[g]), ws, since, now)
        if chosen is None:
            return None
        for gpu in chosen:
            self._gpu_users[gpu] += 1
        return chosen

    def _lease(self, candidates: list[str], ws: int, since: float, now: float) -> list[str] | None:
        if self.leases is None:
            return candidates[:ws] if len(candidates) >= ws else None
        return self.leases.take(candidates, ws, since, now)

    def reserve_spare_memory(self, spec: PoolSpec, need_mb: float) -> bool:
        """Hold a CPU spare of ``spec`` in memory beyond ``max_ranks``: True when ``need_mb``
        (its measured ready RSS, all ranks) fits what other such spares left."""
        if self.uses_gpus(spec) or need_mb <= 0:
            return False
        if self.spare_memory_used_mb + need_mb > self.spare_memory_mb:
            return False
        self.spare_memory_used_mb += need_mb
        return True

    def can_promote(self, spec: PoolSpec, stopping_ranks: int) -> bool:
        """May a spare held in memory take a task now? Only if its ranks fit ``max_ranks``
        beside the other CPU groups, not counting ``stopping_ranks`` (groups on their way
        out compute nothing: typically the group the spare replaces)."""
        return self.cpu_ranks_used - stopping_ranks + spec.world_size <= self.max_ranks

    def promote(self, spec: PoolSpec, memory_mb: float) -> None:
        """A spare held in memory took a task: its ranks count against ``max_ranks`` now."""
        self.spare_memory_used_mb -= memory_mb
        self.cpu_ranks_used += spec.world_size

    def release(self, spec: PoolSpec, gpus: list[str], memory_mb: float = 0.0) -> None:
        """A group is gone; ``memory_mb``: it was a spare held in memory (no core held)."""
        if memory_mb:
            self.spare_memory_used_mb -= memory_mb
        elif not self.uses_gpus(spec):
            self.cpu_ranks_used -= spec.world_size
        for gpu in gpus:
            self._gpu_users[gpu] -= 1

    def would_fit_after_freeing(
        self, spec: PoolSpec, freed: list[tuple[PoolSpec, list[str]]]
    ) -> bool:
        """Would ``spec`` fit if the groups described by ``freed`` were gone?"""
        if not self.uses_gpus(spec):
            extra = sum(s.world_size for s, _ in freed if not self.uses_gpus(s))
            return self.cpu_ranks_used - extra + spec.world_size <= self.max_ranks
        free = set(self.free_gpus())
        if self.leases is not None:
            free -= self.leases.last_attempt.unavailable  # held by other brokers
        for _, gpus in freed:
            free.update(g for g in gpus if self._gpu_users[g] == 1)
        return len(free & set(self.allowed_gpus(spec))) >= spec.world_size
