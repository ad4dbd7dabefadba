"""In-memory stand-ins for the broker's sockets and group processes (no processes, no I/O).

In the spirit of pytest-xdist's ``MockNode`` and dramatiq's ``StubBroker``: a real
:class:`~cpq.broker.loop.Broker` runs against a :class:`FakeWire` that records every frame
it sends, :class:`FakeProcess` groups that start, die and get reaped when told, and a
:class:`~cpq.broker.clock.FakeClock`. :class:`Sim` wraps the three with the steps a test
needs: clients say hello and submit, groups come up, ranks report, time passes.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from cpq import protocol
from cpq.broker.clock import FakeClock
from cpq.broker.config import BrokerConfig
from cpq.broker.loop import Broker
from cpq.broker.model import Group
from cpq.protocol import PoolSpec, RankError, RankResult

TARGET = "tests.unit.targets:noop"


class FakeWire:
    """Records what the broker sends; holds what peers "sent" for :meth:`Broker.serve`."""

    backend_endpoint = "ipc:///fake/backend.sock"

    def __init__(self) -> None:
        self.on_client_gone: Callable[[bytes], None] = lambda identity: None
        self.to_clients: list[tuple[bytes, protocol.Message]] = []
        self.to_ranks: list[tuple[bytes, protocol.Message]] = []
        self.raw_to_ranks: list[tuple[bytes, bytes]] = []  # the frames as sent
        self.heartbeats = 0
        self.unreachable_ranks: set[bytes] = set()
        self.gone_clients: set[bytes] = set()
        self.inbox_clients: deque[list[bytes]] = deque()
        self.inbox_ranks: deque[list[bytes]] = deque()
        self.when_idle: Callable[[], None] = lambda: None
        self.bound = self.closed = False
        self.activity = 0  # task traffic the loop noted (cpq.spin)

    def bind(self) -> None:
        self.bound = True

    def note_activity(self) -> None:
        self.activity += 1

    def poll(self, timeout_s: float) -> tuple[bool, bool]:
        if not self.inbox_clients and not self.inbox_ranks:
            self.when_idle()
        return bool(self.inbox_clients), bool(self.inbox_ranks)

    def recv_client(self) -> list[bytes] | None:
        return self.inbox_clients.popleft() if self.inbox_clients else None

    def recv_rank(self) -> list[bytes] | None:
        return self.inbox_ranks.popleft() if self.inbox_ranks else None

    def send_client(self, identity: bytes, message: protocol.Message | bytes) -> None:
        frame = message if isinstance(message, bytes) else protocol.encode(message)
        if identity in self.gone_clients:
            self.on_client_gone(identity)
            return
        self.to_clients.append((identity, protocol.decode(frame)))

    def send_rank(self, identity: bytes, frame: bytes) -> bool:
        if identity in self.unreachable_ranks:
            return False
        self.raw_to_ranks.append((identity, frame))
        self.to_ranks.append((identity, protocol.decode(frame)))
        return True

    def flush_outbox(self) -> None:
        pass

    def send_heartbeats(self, clients: list[bytes], ranks: list[bytes]) -> None:
        self.heartbeats += 1

    def close(self) -> None:
        self.closed = True


class FakeProcess:
    """A group's process tree that does what the test says."""

    def __init__(self, group_id: str, spec: PoolSpec, backend: str, gpus: list[str]) -> None:
        self.group_id = group_id
        self.spec = spec
        self.backend = backend
        self.token = f"token-{group_id}"
        self.gpus = gpus
        self.rank_pids: set[int] = set()
        self.lease_fds: list[int] = []
        self.node_gpus = True
        self.code: int | None = None
        self.terminated_with: float | None = None
        self.gone_after_terminate = True
        self.fail_start = False
        self._pid: int | None = None

    @property
    def pid(self) -> int | None:
        return self._pid

    def start(self) -> None:
        if self.fail_start:
            raise OSError("no such interpreter (fake)")
        self._pid = 4_000_000  # above pid_max: /proc knows no such process

    def exit_code(self) -> int | None:
        return self.code

    def log_tail(self, max_bytes: int = 4000) -> str:
        return f"the log of {self.group_id}"

    def terminate(self, kill_at: float) -> None:
        self.terminated_with = kill_at

    def reap(self, now: float) -> bool:
        return self.terminated_with is not None and self.gone_after_terminate


def spec(world_size: int = 2, backend: str = "", env: Iterable[tuple[str, str]] = ()) -> PoolSpec:
    return PoolSpec(
        world_size=world_size,
        python=sys.executable,
        roots=[],
        env=[[k, v] for k, v in env],
        backend=backend,
    )


class Sim:
    """A broker on fakes, with the steps of a scenario."""

    def __init__(self, clock: FakeClock | None = None, **config: Any) -> None:
        self.clock = clock or FakeClock()  # shared by Sims that stand for brokers of one node
        self.wire = FakeWire()
        self.processes: dict[str, FakeProcess] = {}
        self.fail_next_start = False
        defaults: dict[str, Any] = {
            "endpoint": "ipc:///fake/broker.sock",
            "state_dir": Path("/nonexistent/state"),
            "log_dir": Path("/nonexistent/logs"),
            "max_ranks": 8,
            "scale_up_after_s": 1.0,
            "spares": 0,  # the spare tests (test_spares.py) turn them on
            "broker_tag": "",  # plain g1, g2: one broker's groups (test_pools: the tag)
        }
        self.config = BrokerConfig(**{**defaults, **config})
        self.broker = Broker(self.config, self.wire, self.clock, self._make_process)
        self._seq = 0

    def _make_process(
        self,
        group_id: str,
        pool_spec: PoolSpec,
        backend: str,
        gpus: list[str],
        endpoint: str,
        heartbeat_s: float,
        liveness: int,
        log_dir: Path,
    ) -> FakeProcess:
        process = FakeProcess(group_id, pool_spec, backend, gpus)
        process.fail_start, self.fail_next_start = self.fail_next_start, False
        self.processes[group_id] = process
        return process

    # ---- peers

    def client(self, identity: bytes = b"c1", **info: Any) -> bytes:
        self.client_send(identity, protocol.Hello(client=info))
        return identity

    def client_send(self, identity: bytes, message: protocol.Message) -> None:
        self.broker.controller.on_client_frames([identity, protocol.encode(message)])

    def rank_send(self, identity: bytes, message: protocol.Message) -> None:
        self.broker.controller.on_rank_frames([identity, protocol.encode(message)])

    def submit(
        self,
        client: bytes = b"c1",
        task_id: str | None = None,
        pool_spec: PoolSpec | None = None,
        timeout: float | None = None,
        target: str = TARGET,
        test_id: str = "",
        affinity: str = "",
        **fields: Any,
    ) -> str:
        if task_id is None:
            self._seq += 1
            task_id = f"t{self._seq}"
        self.client_send(
            client,
            protocol.Submit(
                task_id=task_id,
                target=target,
                spec=pool_spec or spec(),
                timeout=timeout,
                test_id=test_id,
                affinity=affinity,
                **fields,
            ),
        )
        return task_id

    @staticmethod
    def rank_id(group_id: str, rank: int) -> bytes:
        return f"{group_id}/r{rank}".encode()

    def bring_up(
        self,
        group_id: str,
        rss_mb: float = 100.0,
        features: Iterable[str] = protocol.ALL_FEATURES,
    ) -> Group:
        """Every rank of ``group_id`` says hello and ready (reading ``features``)."""
        group = self.broker.pools.groups[group_id]
        for rank in range(group.spec.world_size):
            self.rank_hello(group_id, rank)
        for rank in range(group.spec.world_size):
            self.rank_send(
                self.rank_id(group_id, rank),
                protocol.RankReady(
                    rank=rank, startup_s=1.0, rss_mb=rss_mb, features=sorted(features)
                ),
            )
        return group

    def rank_hello(self, group_id: str, rank: int, token: str | None = None) -> None:
        process = self.processes[group_id]
        self.rank_send(
            self.rank_id(group_id, rank),
            protocol.RankHello(
                group_id=group_id,
                token=process.token if token is None else token,
                rank=rank,
                local_rank=rank,
                pid=5_000_000 + rank,
            ),
        )

    def report(
        self,
        group_id: str,
        rank: int,
        task_id: str,
        outcome: str = "passed",
        rss_mb: float = 100.0,
        unfit: str = "",
        value: Any = None,
    ) -> None:
        error = None
        if outcome != "passed":
            error = RankError(f"Fake{outcome.title()}", f"rank {rank} {outcome}", "tb")
        result = RankResult(rank=rank, outcome=outcome, error=error, value=value)
        self.rank_send(
            self.rank_id(group_id, rank),
            protocol.RankDone(task_id=task_id, result=result, rss_mb=rss_mb, unfit=unfit),
        )

    def finish_all(self, group_id: str, task_id: str, outcome: str = "passed") -> None:
        group = self.broker.pools.groups[group_id]
        for rank in range(group.spec.world_size):
            self.report(group_id, rank, task_id, outcome)

    def stacks(
        self, group_id: str, rank: int, task_id: str, text: str, stdout: str = "", stderr: str = ""
    ) -> None:
        self.rank_send(
            self.rank_id(group_id, rank),
            protocol.RankStacks(
                task_id=task_id, rank=rank, stacks=text, stdout=stdout, stderr=stderr
            ),
        )

    def heartbeat_all(self) -> None:
        """Every registered rank and every client sends a heartbeat now."""
        for identity in list(self.broker.pools.ranks):
            self.rank_send(identity, protocol.Heartbeat())
        for identity in list(self.broker.clients):
            self.client_send(identity, protocol.Heartbeat())

    def tick(self, seconds: float = 0.0, heartbeats: bool = True) -> None:
        """Let ``seconds`` pass in heartbeat-sized steps (peers heartbeat unless told not)."""
        remaining = seconds
        while True:
            step = min(remaining, self.config.heartbeat_s / 2)
            self.clock.advance(step)
            remaining -= step
            if heartbeats:
                self.heartbeat_all()
            self.broker.tick(self.clock.monotonic())
            if remaining <= 1e-9:
                return

    # ---- looking

    def done(self, client: bytes = b"c1") -> dict[str, protocol.TaskResult]:
        return {
            m.result.task_id: m.result
            for who, m in self.wire.to_clients
            if who == client and isinstance(m, protocol.Done)
        }

    def errors(self, client: bytes = b"c1") -> list[str]:
        return [
            m.message
            for who, m in self.wire.to_clients
            if who == client and isinstance(m, protocol.ErrorReply)
        ]

    def sent_to_ranks(self, kind: type[protocol.Message]) -> list[tuple[bytes, Any]]:
        return [(who, m) for who, m in self.wire.to_ranks if isinstance(m, kind)]

    def states(self) -> dict[str, str]:
        return {g.id: g.state for g in self.broker.pools.groups.values()}

    def running(self, group_id: str) -> str | None:
        task = self.broker.pools.groups[group_id].task
        return task.submit.task_id if task else None
