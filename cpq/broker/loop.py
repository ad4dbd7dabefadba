"""The broker: one event loop between clients (frontend ROUTER) and ranks (backend ROUTER).

Every incoming message is decoded and dispatched by the socket-facing
:class:`~cpq.broker.controller.Controller` through a handler table keyed by message class,
one table per socket, which the broker fills once; whatever a table does not hold is
dropped, counted as ``malformed`` and logged; the broker keeps serving. Everything
time-driven (heartbeats, deadlines, the grace after a rank failed, kill escalation, start
time-outs, idle exit) happens in :meth:`Broker.tick`, which the loop runs at least every
``TICK_S``; polls are never infinite.

The loop is the only place that coordinates :class:`~cpq.broker.pools.Pools` (groups) and
:class:`~cpq.broker.tasks.Tasks` (the task lifecycle): after every event it carries out
what they asked for (:meth:`Broker.settle`) and then asks placement
(:mod:`cpq.broker.placement`, through :class:`~cpq.broker.placing.Placer`) what to run,
start and stop. See ``docs/design.md``.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any, Protocol

from cpq import protocol
from cpq.broker import liveness, notices, snapshot
from cpq.broker.clock import Clock, SystemClock
from cpq.broker.config import BrokerConfig
from cpq.broker.controller import Controller
from cpq.broker.model import Client, Group, Rank, Totals
from cpq.broker.placement import admission
from cpq.broker.placing import Placer
from cpq.broker.pools import Pools, ProcessFactory, real_process
from cpq.broker.tasks import GroupRequest, Tasks
from cpq.broker.timeline import Timeline
from cpq.broker.transport import BrokerAlreadyRunning, Transport
from cpq.timeline.records import timeline_path

log = logging.getLogger("cpq.broker")

TICK_S = 0.05
#: Messages after which placement has nothing new to decide: they change no queue, group,
#: client or want. A rank's report that ends its task leaves a group request, and a refusal
#: a request too, which :meth:`Broker.settle` sees; one that does not end it changes nothing
#: placement reads (its memory figures count when the group is next placed).
NOTHING_TO_PLACE = (
    protocol.Heartbeat,
    protocol.StatusRequest,
    protocol.Hello,
    protocol.RankBegun,
    protocol.RankStacks,
    protocol.RankDone,
    protocol.DebugOutput,
)
#: Messages after which the next one is likely to come within a moment (the ranks' reports
#: after a dispatch, the next submit after a verdict): the loop spins a moment before it
#: blocks (:mod:`cpq.spin`). Not heartbeats: every peer sends one a second.
TASK_TRAFFIC = (protocol.Submit, protocol.RankDone, protocol.RankReady)
#: Messages handled from one socket before the other gets its turn.
DRAIN_BUDGET = 1000

__all__ = ["TICK_S", "Broker", "BrokerAlreadyRunning", "BrokerConfig", "run_broker"]


class Wire(Protocol):
    """What the loop needs of its sockets: :class:`~cpq.broker.transport.Transport`, or
    a fake in unit tests."""

    backend_endpoint: str
    on_client_gone: Callable[[bytes], None]

    def bind(self) -> None: ...

    def poll(self, timeout_s: float) -> tuple[bool, bool]: ...

    def recv_client(self) -> list[bytes] | None: ...

    def recv_rank(self) -> list[bytes] | None: ...

    def send_client(self, identity: bytes, message: protocol.Message | bytes) -> None: ...

    def send_rank(self, identity: bytes, frame: bytes) -> bool: ...

    def flush_outbox(self) -> None: ...

    def send_heartbeats(self, clients: list[bytes], ranks: list[bytes]) -> None: ...

    def note_activity(self) -> None: ...

    def close(self) -> None: ...


class Broker:
    def __init__(
        self,
        config: BrokerConfig,
        transport: Wire | None = None,
        clock: Clock | None = None,
        process_factory: ProcessFactory = real_process,
    ) -> None:
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self.transport: Wire = transport or Transport(config)
        self.transport.on_client_gone = self._client_gone
        self.totals = Totals()
        self.clients: dict[bytes, Client] = {}
        self.timeline = Timeline(
            timeline_path(config.timings_file) if config.timings_file else None,
            config.timings_max_bytes,
            self.clock,
        )
        self.pools = Pools(
            config,
            self.clock,
            self.totals,
            self.transport.send_rank,
            self.transport.backend_endpoint,
            process_factory,
            self.timeline,
        )
        self.tasks = Tasks(
            config,
            self.clock,
            self.totals,
            self.clients,
            self.pools.room,
            self.transport.send_client,
            self.transport.send_rank,
            self.timeline,
        )
        self.placer = Placer(self.pools, self.tasks)
        self.started_at = self.clock.time()
        self.idle_since = self.clock.monotonic()
        self.stopping = False
        #: Whether placement has something new to read (see :meth:`settle`).
        self._to_place = True
        self._last_heartbeat = -float("inf")
        self.controller = Controller(
            self.clock,
            self.totals,
            self.clients,
            self.pools.ranks,
            self.transport.send_client,
            self.pools.rank_hello,
            self.after_message,
        )
        self.controller.client_handlers.update(
            {
                protocol.Hello: self.client_hello,
                protocol.Heartbeat: lambda client, message: None,
                protocol.Goodbye: lambda client, message: self.drop_client(client, "said goodbye"),
                protocol.StatusRequest: self.client_status,
                protocol.StopRequest: self.client_stop,
                protocol.Submit: self.client_submit,
                protocol.Cancel: lambda client, message: self.tasks.cancel(client, message.task_id),
                protocol.Warm: self.client_warm,
                protocol.DebugAttach: lambda client, m: self.tasks.debug.attach(client, m),
                protocol.DebugLine: lambda client, m: self.tasks.debug.line(client, m),
            }
        )
        self.controller.rank_handlers.update(
            {
                protocol.Heartbeat: lambda group, rank, message: None,
                protocol.RankReady: self.rank_ready,
                protocol.RankDone: self.rank_done,
                protocol.RankStacks: lambda g, rank, m: self.tasks.rank_stacks(g, rank.rank, m),
                protocol.RankBegun: lambda g, rank, m: self.tasks.rank_begun(g, rank.rank, m),
                protocol.RankStale: lambda g, rank, m: self.pools.rank_stale(g, m),
                protocol.DebugOutput: lambda g, rank, m: self.tasks.debug.output(g, rank.rank, m),
            }
        )
        self.controller.on_rank_unreadable = lambda g, r, why: self.tasks.unreadable(g, r.rank, why)

    @property
    def draining(self) -> bool:
        return self.tasks.draining

    # ---- running

    def bind(self) -> None:
        self.transport.bind()

    def serve(self) -> None:
        next_tick = 0.0
        while not self.stopping:
            clients_sent, ranks_sent = self.transport.poll(TICK_S)
            if ranks_sent:
                self._drain(self.transport.recv_rank, self.controller.on_rank_frames)
            if clients_sent:
                self._drain(self.transport.recv_client, self.controller.on_client_frames)
            now = self.clock.monotonic()
            if now >= next_tick:
                self.tick(now)
                next_tick = now + TICK_S

    def _drain(
        self, recv: Callable[[], list[bytes] | None], handle: Callable[[list[bytes]], None]
    ) -> None:
        """Handle what is waiting (bounded, so one side cannot starve the other)."""
        for _ in range(DRAIN_BUDGET):
            frames = recv()
            if frames is None:
                return
            handle(frames)

    def close(self) -> None:
        if self.pools.sharing is not None:
            self.pools.sharing.close()
        self.pools.close(time.sleep)
        self.timeline.flush()
        self.transport.close()
        log.info("broker stopped")

    # ---- clients

    def client_hello(self, client: Client, message: protocol.Hello) -> None:
        client.info = message.client
        client.greeted = True
        self.timeline.hello(client)
        self.transport.send_client(client.identity, protocol.Welcome(self.describe()))

    def client_status(self, client: Client, message: protocol.StatusRequest) -> None:
        self.transport.send_client(client.identity, protocol.StatusReply(self.status()))

    def client_stop(self, client: Client, message: protocol.StopRequest) -> None:
        log.info("stop requested (drain=%s)", message.drain)
        self.transport.send_client(client.identity, protocol.StatusReply(self.status()))
        if message.drain:
            self.tasks.draining = True
        else:
            self.stop_now("the broker was stopped (cpq stop)")

    def client_submit(self, client: Client, message: protocol.Submit) -> None:
        if message.env_same:  # the variables of this client's previous submit
            if client.last_env is None:
                self.totals.malformed += 1
                self.transport.send_client(
                    client.identity,
                    protocol.ErrorReply("env_same before any task variables", message.task_id),
                )
                return
            message.env, message.env_same = client.last_env, False
        else:
            client.last_env = message.env
        self.tasks.submit(client, message)

    def client_warm(self, client: Client, message: protocol.Warm) -> None:
        if self.draining:
            return  # a draining broker is on its way out: no new groups for future tasks
        counts = message.counts
        wanted = [counts[i] if i < len(counts) else 1 for i in range(len(message.specs))]
        self.placer.requests.warm += zip(message.specs, wanted, strict=True)

    def warm_up(self) -> None:
        """Start the ``--warm`` groups now, so the first clients find them ready."""
        for spec, _ in self.config.warm:
            impossible = admission.impossible(spec, self.pools.room)
            if impossible:
                log.warning("--warm %s: %s", spec.label(), impossible)
        self.placer.requests.warm += self.config.warm
        self._to_place = True
        self.settle()
        for spec, count in self.config.warm:
            live = len(self.pools.live(spec))
            if live < count and not admission.impossible(spec, self.pools.room):
                log.warning("--warm %s: room for %d of %d groups only", spec.label(), live, count)

    def drop_client(self, client: Client, why: str) -> None:
        self.clients.pop(client.identity, None)
        dropped = self.tasks.drop_client(client)
        if dropped or client.in_flight:
            log.info("client %s %s: dropped %d queued task(s)", client.identity.hex(), why, dropped)

    def _client_gone(self, identity: bytes) -> None:
        client = self.clients.get(identity)
        if client is not None:
            self.drop_client(client, "is gone")

    # ---- ranks

    def rank_ready(self, group: Group, rank: Rank, message: protocol.RankReady) -> None:
        self.pools.rank_ready(group, rank, message)

    def rank_done(self, group: Group, rank: Rank, message: protocol.RankDone) -> None:
        self.pools.rank_report(group, rank, message)
        self.tasks.rank_done(group, rank.rank, message)

    # ---- coordination

    def after_message(self, message: protocol.Message | None) -> None:
        """A message was handled: placement runs again unless the message is one that
        changes nothing it reads (see :data:`NOTHING_TO_PLACE`)."""
        if not isinstance(message, NOTHING_TO_PLACE):
            self._to_place = True
        if isinstance(message, TASK_TRAFFIC):  # the next one is likely soon: spin a moment
            self.transport.note_activity()
        self.settle()

    def settle(self) -> None:
        """Carry out what pools and tasks asked for, then schedule, until nothing is left.

        Placement runs when something it reads may have changed: a message not in
        :data:`NOTHING_TO_PLACE`, a tick, or a request or failure carried out here. A
        round trip's other events (a rank's report that does not end its task, heartbeats,
        status requests) then cost no snapshot of every group."""
        while True:
            for request in self.tasks.take_group_requests():
                if request.stop_reason:
                    self.pools.stop(request.group, request.stop_reason)
                else:
                    self.pools.release(request.group)
                self._to_place = self._to_place or self._places(request)
            failures = self.pools.take_failures()
            self._to_place = self._to_place or bool(failures)
            for failure in failures:
                group = failure.group
                if failure.task is not None:
                    self.tasks.infra_error(failure.task, failure.reason)
                elif failure.was_starting and (
                    group.reserved_for or not self.pools.serving(group.spec)
                ):
                    # A group started for one task (fresh_group): that task alone waited
                    # for it, and only another start of its own could serve it.
                    self.tasks.start_failed(
                        group.spec,
                        f"group {group.id} could not start: {failure.reason}",
                        failure.log_tail,
                        only=group.reserved_for,
                    )
            if not failures and not self.tasks.group_requests:
                if self._to_place:
                    self._to_place = False
                    self.schedule()
                if not self.pools.failures and not self.tasks.group_requests:
                    return

    def _places(self, request: GroupRequest) -> bool:
        """Whether carrying ``request`` out gives placement something to do now: a stop
        does; a release only when :meth:`Placer.after_release` says so. Skipping the rest
        is one placement a task less on the round trip's path: the client's next submit no
        longer queues behind it (docs/design.md "Dispatch")."""
        return bool(request.stop_reason) or self.placer.after_release(request.group)

    def schedule(self) -> None:
        """What placement decides: queued tasks onto groups, groups started and stopped.
        A lone task whose group is plain goes first (:meth:`Placer.express`)."""
        if self.stopping:
            return
        if self.placer.express(closing=self.draining) and self.pools.failures:
            return  # its group was unreachable: settle() carries that out, then places
        self.placer.place(closing=self.draining)

    # ---- time

    def tick(self, now: float) -> None:
        self.transport.flush_outbox()
        if now - self._last_heartbeat >= self.config.heartbeat_s:
            self._last_heartbeat = now
            self.transport.send_heartbeats(
                [i for i, c in self.clients.items() if c.greeted], list(self.pools.ranks)
            )
        for client in list(self.clients.values()):
            quiet, excused = liveness.quiet_for(
                client.busy_watch,
                now,
                client.last_seen,
                client.local_pid(),
                self.config.heartbeat_s,
                client.label,
            )
            self.totals.busy_silences += excused
            if quiet > self.config.silence_s:
                self.drop_client(client, f"silent for {now - client.last_seen:.1f}s")
        self.pools.tick(now)
        self._to_place = True  # what waits on time: growth, spares, yielding, start time-outs
        self.settle()
        self.tasks.tick(now)
        self.tasks.debug.tick()
        self.pools.history.forget(now, self.config.spare_window_s)
        if self.pools.sharing is not None:  # other brokers' wants, ours: placement's input
            self.pools.sharing.tick(self.pools.groups)
        self._to_place = True  # also: queued tasks may have waited long enough to grow a pool
        self.settle()
        self._say_why_waiting(now)
        self.timeline.flush()
        if self.draining and not self.tasks.tasks:
            self.stop_now("drained")
        if self.tasks.tasks or self.clients:
            self.idle_since = now
        elif self.config.idle_exit_s and now - self.idle_since > self.config.idle_exit_s:
            log.info("idle for %.0fs; exiting", now - self.idle_since)
            self.stop_now("idle")

    def stop_now(self, why: str) -> None:
        self.tasks.stop_all(why)
        closing = protocol.encode(protocol.Closing(reason=why))
        for identity, client in list(self.clients.items()):  # a send may drop a client
            if client.greeted and "broker-closing" in client.features():
                self.transport.send_client(identity, closing)  # they hear why, at once
        self.transport.flush_outbox()
        self.stopping = True

    def _say_why_waiting(self, now: float) -> None:
        every = self.config.waiting_notice_s
        for identity, notice in notices.due(self.tasks, self.pools, self.clients, now, every):
            self.transport.send_client(identity, notice)

    # ---- status

    def describe(self) -> dict[str, Any]:
        return snapshot.describe(self.config, self.pools, self.tasks, self.started_at, self.clock)

    def status(self) -> dict[str, Any]:
        return snapshot.status(
            self.config,
            self.pools,
            self.tasks,
            self.clients,
            self.totals,
            self.started_at,
            self.clock,
        )


# --------------------------------------------------------------------------- running


def run_broker(config: BrokerConfig) -> None:
    broker = Broker(config)
    broker.bind()
    broker.warm_up()

    def _on_signal(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        broker.stop_now(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        broker.serve()
    finally:
        broker.close()
