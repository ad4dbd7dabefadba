"""The queues: which queued task of a spec is handed out next.

One queue per pool spec, and inside it one FIFO per client served round-robin, so one client
with a thousand queued tasks cannot starve another with one. Which group a task goes to,
and which group starts, is the placement's (:mod:`cpq.broker.placement`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

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

    def head(self, count: int) -> list[T]:
        """The next ``count`` tasks :meth:`pop` would return, in that order (left queued)."""
        turns = deque((client, iter(fifo)) for client, fifo in self._by_client.items())
        out: list[T] = []
        while turns and len(out) < count:
            client, rest = turns.popleft()
            task = next(rest, None)
            if task is None:
                continue
            out.append(task)
            turns.append((client, rest))
        return out

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
