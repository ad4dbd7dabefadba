"""The broker: one event loop between clients (frontend ROUTER) and ranks (backend ROUTER).

Every incoming message is decoded by :mod:`cpq.protocol` and dispatched to a handler named
after its kind (``client_submit``, ``rank_done``, ...), the way pytest-xdist's DSession
dispatches ``worker_<event>``. Everything time-driven (heartbeats, deadlines, the grace
after a rank failed, kill escalation, start time-outs, idle exit) happens in :meth:`tick`,
which the loop runs at least every ``TICK_S``; polls are never infinite.

A task's life: queued → running on one idle group of its spec (the same ``run`` frame goes
to every rank) → per-rank reports are collected → one verdict goes back to the client. The
ways a task can end are DESIGN.md's outcome table; infra errors (deadline, a dead or silent
rank, a group that would not start) are retried once on a fresh group.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import zmq

from cpq import __version__, protocol, security, snapshot, timings
from cpq.autostart import code_fingerprint
from cpq.liveness import BusyWatch, pid_namespace
from cpq.protocol import PoolSpec, RankError, RankResult, TaskResult
from cpq.scheduler import Queues, Resources
from cpq.supervisor import GroupProcess

log = logging.getLogger("cpq.broker")

# Which clients' processes this broker can look at (see Client.local_pid).
_HOST, _PIDNS = socket.gethostname(), pid_namespace()

TICK_S = 0.05


class BrokerAlreadyRunning(RuntimeError):
    pass


@dataclass
class BrokerConfig:
    endpoint: str
    state_dir: Path
    log_dir: Path
    gpus: list[str] = field(default_factory=list)
    max_ranks: int = 8
    oversubscribe: bool = False
    heartbeat_s: float = 1.0
    liveness: int = 5
    idle_exit_s: float = 0.0
    start_timeout_s: float = 300.0
    failure_grace_s: float = 3.0
    stack_wait_s: float = 2.0
    kill_grace_s: float = 3.0
    max_tasks_per_group: int = 0
    default_timeout_s: float = 90.0
    insecure: bool = False
    scale_up_after_s: float = 1.0
    #: Finished tasks are appended here, one JSON line each (None: keep no history).
    timings_file: Path | None = None
    timings_max_bytes: int = timings.DEFAULT_MAX_BYTES
    #: Learned deadlines: max(floor, k x the slowest passing run) for tasks with history.
    adaptive_timeout: bool = False
    adaptive_k: float = 3.0
    adaptive_floor_s: float = 30.0
    #: Recycle a group after a task once a rank's RSS grew this much since ready (0: never).
    max_rss_growth_mb: float = 0.0
    #: Groups to start at start-up, as (spec, count) (``--warm``).
    warm: list[tuple[PoolSpec, int]] = field(default_factory=list)


# --------------------------------------------------------------------------- state


@dataclass
class Client:
    identity: bytes
    info: dict[str, Any] = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)
    connected_at: float = field(default_factory=time.time)
    in_flight: set[str] = field(default_factory=set)
    submitted: int = 0
    #: Said hello. Only greeted clients get heartbeats: a client the broker dropped (silent
    #: too long) or never knew (it outlived a broker restart) hears nothing, so it reports
    #: BrokerUnavailable instead of waiting forever for tasks this broker does not have.
    greeted: bool = False
    busy_watch: BusyWatch = field(default_factory=BusyWatch)

    def local_pid(self) -> int | None:
        """The client's pid if this broker can look at its process: same host and same pid
        namespace (a client in another container has its own pids)."""
        pid = self.info.get("pid")
        same_node = self.info.get("host") == _HOST
        same_pids = self.info.get("pidns") is not None and self.info["pidns"] == _PIDNS
        return pid if same_node and same_pids and isinstance(pid, int) and pid > 0 else None


@dataclass
class Task:
    client: bytes
    submit: protocol.Submit
    spec: PoolSpec
    timeout_s: float
    queued_at: float = field(default_factory=time.monotonic)
    attempts: int = 1
    notes: list[str] = field(default_factory=list)
    group: Group | None = None
    started_at: float = 0.0
    deadline: float = 0.0
    results: dict[int, RankResult] = field(default_factory=dict)
    grace_until: float | None = None
    # Stack collection (after a deadline or a peer's failure): why, until when, what came back.
    stacks_reason: str = ""
    stacks_until: float | None = None
    stacks: dict[int, str] = field(default_factory=dict)
    orphaned: bool = False
    first_queued_at: float = 0.0
    # The deadline the client asked for; with --adaptive-timeout, ``timeout_s`` may be a
    # learned one instead, and ``deadline_note`` says how it was learned.
    requested_timeout_s: float = 0.0
    deadline_note: str = ""
    last_group_id: str = ""  # survives a retry's reset of ``group``, for the timing history

    @property
    def key(self) -> str:
        return f"{self.client.hex()}:{self.submit.task_id}"


@dataclass
class Rank:
    identity: bytes
    rank: int
    pid: int
    last_seen: float = field(default_factory=time.monotonic)
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
    started_at: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    ready_after_s: float | None = None
    ready_at: float = 0.0
    last_used: float = field(default_factory=time.monotonic)
    rss_mb: dict[int, float] = field(default_factory=dict)
    stop_reason: str = ""
    rss_ready_mb: dict[int, float] = field(default_factory=dict)  # baseline for growth
    cuda_mb: dict[int, float] = field(default_factory=dict)
    cuda_reserved_mb: dict[int, float] = field(default_factory=dict)
    unfit: dict[int, str] = field(default_factory=dict)  # rank -> why it cannot go on


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
    malformed: int = 0
    groups_recycled: int = 0
    timings_write_errors: int = 0
    busy_silences: int = 0  # ranks or clients silent past liveness but computing: not dead


# --------------------------------------------------------------------------- broker


class Broker:
    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.resources = Resources(config.gpus, config.max_ranks, config.oversubscribe)
        self.queues: Queues[Task] = Queues()
        self.clients: dict[bytes, Client] = {}
        self.tasks: dict[str, Task] = {}
        self.groups: dict[str, Group] = {}
        self.ranks: dict[bytes, tuple[Group, Rank]] = {}
        self.totals = Totals()
        self.started_at = time.time()
        self.idle_since = time.monotonic()
        self.draining = False
        self._interpreters: set[str] = set()  # interpreters seen to be executable
        self.stopping = False
        self._outbox: list[tuple[bytes, bytes]] = []
        self._heartbeat = protocol.encode(protocol.Heartbeat())
        self._last_heartbeat = 0.0
        self._group_seq = 0
        self._lock_file: IO[str] | None = None
        self.timings = timings.TimingsLog(config.timings_file, config.timings_max_bytes)
        self.history = timings.History()
        if config.adaptive_timeout and config.timings_file is not None:
            loaded = self.history.load(timings.read(config.timings_file))
            log.info(
                "learned deadlines from %d finished tasks (%d tests) in %s",
                loaded,
                len(self.history.slowest),
                config.timings_file,
            )
        self.backend_endpoint = f"ipc://{config.state_dir / f'backend-{os.getpid()}.sock'}"

    # ---- sockets

    def bind(self) -> None:
        """Take the endpoint's lock and bind both ROUTERs (refuses a second broker)."""
        from cpq import paths

        lock_path = paths.lock_path(self.config.endpoint)
        self._lock_file = open(lock_path, "a+")  # noqa: SIM115 - held for the broker's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BrokerAlreadyRunning(
                f"another broker already serves {self.config.endpoint}"
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(f"{os.getpid()}\n{code_fingerprint()}\n")  # autostart reads it
        self._lock_file.flush()
        self._remove_stale_backend_sockets()
        self.context: zmq.Context[Any] = zmq.Context()
        self.frontend = self._router(self.config.endpoint, public=True)
        self.backend = self._router(self.backend_endpoint)
        log.info(
            "cpq-broker %s pid %d serving %s (GPUs: %s, max CPU ranks: %d)",
            __version__,
            os.getpid(),
            self.config.endpoint,
            ",".join(self.config.gpus) or "none",
            self.config.max_ranks,
        )

    def _remove_stale_backend_sockets(self) -> None:
        """Remove ``backend-<pid>.sock`` files of brokers that died without cleaning up."""
        for path in self.config.state_dir.glob("backend-*.sock"):
            pid = path.name[len("backend-") : -len(".sock")]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:  # that broker is gone (SIGKILL leaves its socket)
                with contextlib.suppress(OSError):
                    path.unlink()
                    log.info("removed the stale backend socket %s", path)
            except PermissionError:
                pass  # alive, someone else's process

    def _router(self, endpoint: str, public: bool = False) -> zmq.Socket[Any]:
        sock = self.context.socket(zmq.ROUTER)
        if public:
            self._authenticator = security.configure_server(
                self.context, sock, endpoint, self.config.insecure
            )
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None
        if path and os.path.exists(path):
            os.unlink(path)  # a stale socket of a dead broker; we hold the lock
        old_umask = os.umask(0o077)
        try:
            sock.bind(endpoint)
        finally:
            os.umask(old_umask)
        return sock

    def close(self) -> None:
        for group in list(self.groups.values()):
            group.process.terminate(0.0)
        deadline = time.monotonic() + self.config.kill_grace_s + 2
        while time.monotonic() < deadline and not all(
            g.process.reap() for g in self.groups.values()
        ):
            time.sleep(0.05)
        for group in self.groups.values():
            group.process.terminate(0.0)
            group.process.reap()
        for sock in (getattr(self, "frontend", None), getattr(self, "backend", None)):
            if sock is not None:
                sock.close(0)
        for endpoint in (self.config.endpoint, self.backend_endpoint):
            if endpoint.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(endpoint[len("ipc://") :])
        if getattr(self, "_authenticator", None) is not None:
            self._authenticator.stop()
        if self._lock_file is not None:
            self._lock_file.close()
        log.info("broker stopped")

    # ---- loop

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        next_tick = 0.0
        while not self.stopping:
            events = dict(poller.poll(timeout=int(TICK_S * 1000)))
            if self.backend in events:
                self._drain(self.backend, self._on_rank_frame)
            if self.frontend in events:
                self._drain(self.frontend, self._on_client_frame)
            now = time.monotonic()
            if now >= next_tick:
                self.tick(now)
                next_tick = now + TICK_S

    def _drain(self, sock: zmq.Socket[Any], handler: Any, budget: int = 1000) -> None:
        """Handle what is waiting on ``sock`` (bounded, so one side cannot starve the other)."""
        for _ in range(budget):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.totals.malformed += 1
                log.warning(
                    "dropping a message of %d frames (expected 1 payload frame)", len(frames) - 1
                )
                if frames and sock is self.frontend:
                    self._send_client(
                        frames[0], protocol.ErrorReply("expected exactly one payload frame")
                    )
                continue
            handler(frames[0], frames[1])

    # ---- frontend

    def _on_client_frame(self, identity: bytes, frame: bytes) -> None:
        client = self.clients.get(identity)
        if client is None:
            client = self.clients[identity] = Client(identity)
        client.last_seen = time.monotonic()
        try:
            message = protocol.decode(frame)
        except protocol.ProtocolError as exc:
            self.totals.malformed += 1
            log.warning("malformed message from client %s: %s", identity.hex(), exc)
            self._send_client(identity, protocol.ErrorReply(f"malformed message: {exc}"))
            return
        handler = getattr(self, f"client_{message.KIND}", None)
        if handler is None:
            self._send_client(
                identity, protocol.ErrorReply(f"{message.KIND!r} is not a client message")
            )
            return
        handler(client, message)

    def client_hello(self, client: Client, message: protocol.Hello) -> None:
        client.info = message.client
        client.greeted = True
        self._send_client(client.identity, protocol.Welcome(self.describe()))

    def client_hb(self, client: Client, message: protocol.Heartbeat) -> None:
        pass

    def client_bye(self, client: Client, message: protocol.Goodbye) -> None:
        self._drop_client(client, "said goodbye")

    def client_status(self, client: Client, message: protocol.StatusRequest) -> None:
        self._send_client(client.identity, protocol.StatusReply(self.status()))

    def client_stop(self, client: Client, message: protocol.StopRequest) -> None:
        log.info("stop requested (drain=%s)", message.drain)
        self._send_client(client.identity, protocol.StatusReply(self.status()))
        if message.drain:
            self.draining = True
        else:
            self._stop_now("the broker was stopped (cpq stop)")

    def client_submit(self, client: Client, message: protocol.Submit) -> None:
        self.totals.submitted += 1
        client.submitted += 1
        spec = message.spec
        reason = self._reject_reason(message)
        requested = message.timeout or self.config.default_timeout_s
        timeout_s, deadline_note = self._deadline_for(message, requested)
        task = Task(
            client=client.identity,
            submit=message,
            spec=spec,
            timeout_s=timeout_s,
            requested_timeout_s=requested,
            deadline_note=deadline_note,
        )
        task.first_queued_at = task.queued_at
        if task.key in self.tasks:
            reason = f"task id {message.task_id!r} is already in flight for this client"
        if reason:
            self.totals.rejected += 1
            log.info("rejected %s: %s", message.target, reason)
            self._finish(task, "error", message=f"rejected: {reason}")
            return
        self.tasks[task.key] = task
        client.in_flight.add(task.key)
        self.queues.push(task)
        self._schedule()

    def _deadline_for(self, message: protocol.Submit, requested: float) -> tuple[float, str]:
        """The task's deadline: learned from history with --adaptive-timeout, else requested.

        A learned deadline catches a hang after a few times the test's known worst case
        instead of after the suite-wide default, which is sized for the slowest test.
        """
        if not self.config.adaptive_timeout:
            return requested, ""
        return self.history.deadline(
            timings.history_key(message.test_id, message.target),
            requested,
            self.config.adaptive_k,
            self.config.adaptive_floor_s,
        )

    def _reject_reason(self, message: protocol.Submit) -> str:
        if self.draining:
            return "the broker is draining and accepts no new tasks"
        module, sep, attr = message.target.partition(":")
        if not sep or not module or not attr:
            return f"target {message.target!r} must look like 'package.module:function'"
        if message.timeout is not None and not 0 < message.timeout < math.inf:
            # NaN and inf too: a deadline that never fires lets one hung test hold a group
            # (and its GPUs) for good; heartbeats only catch dead ranks, not stuck ones.
            return f"timeout must be a positive, finite number of seconds, got {message.timeout}"
        impossible = self.resources.impossible(message.spec)
        if impossible:
            return impossible
        python = message.spec.python
        if python not in self._interpreters:  # a syscall per new interpreter, not per task
            if not (os.path.isabs(python) and os.access(python, os.X_OK)):
                return f"interpreter {python!r} is not an executable on this node"
            self._interpreters.add(python)  # one removed later fails its group's start
        return ""

    def client_cancel(self, client: Client, message: protocol.Cancel) -> None:
        task = self.tasks.get(f"{client.identity.hex()}:{message.task_id}")
        if task is None:
            return
        if task.group is None:
            self.queues.remove(lambda t: t is task)
            self._finish(task, "error", message="cancelled by the client")
        else:
            task.orphaned = True  # let it finish; the result goes nowhere

    def client_warm(self, client: Client, message: protocol.Warm) -> None:
        if self.draining:
            return  # a draining broker is on its way out: no new groups for future tasks
        for index, spec in enumerate(message.specs):
            if self.resources.impossible(spec):
                continue
            wanted = message.counts[index] if index < len(message.counts) else 1
            have = sum(1 for g in self.groups.values() if g.spec == spec and g.state != "stopping")
            for _ in range(max(0, wanted - have)):
                if self._start_group(spec) is None:
                    break

    def warm_up(self) -> None:
        """Start the ``--warm`` groups now, so the first clients find them ready.

        They only serve clients whose spec is equal, roots and interpreter included (see
        ``cpq-broker --help`` on ``--warm-root``); a mismatch leaves them idle, never wrong.
        """
        for spec, count in self.config.warm:
            impossible = self.resources.impossible(spec)
            if impossible:
                log.warning("--warm %s: %s", spec.label(), impossible)
                continue
            for started in range(count):
                if self._start_group(spec) is None:
                    log.warning(
                        "--warm %s: room for %d of %d groups only", spec.label(), started, count
                    )
                    break

    # ---- backend

    def _on_rank_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            message = protocol.decode(frame)
        except protocol.ProtocolError as exc:
            self.totals.malformed += 1
            log.warning("malformed message from rank peer %s: %s", identity.hex(), exc)
            return
        if isinstance(message, protocol.RankHello):
            self.rank_hello(identity, message)
            return
        known = self.ranks.get(identity)
        if known is None:
            log.warning("dropping %r from an unknown rank peer %s", message.KIND, identity.hex())
            return
        group, rank = known
        rank.last_seen = time.monotonic()
        handler = getattr(self, f"rank_{message.KIND.removeprefix('rank_')}", None)
        if handler is not None:
            handler(group, rank, message)

    def rank_hello(self, identity: bytes, message: protocol.RankHello) -> None:
        group = self.groups.get(message.group_id)
        if group is None or group.process.token != message.token or group.state == "stopping":
            log.warning(
                "refusing rank hello for group %s (unknown, stopping or bad token)",
                message.group_id,
            )
            return
        rank = Rank(identity, message.rank, message.pid)
        group.ranks[message.rank] = rank
        group.process.rank_pids.add(message.pid)
        self.ranks[identity] = (group, rank)

    def rank_hb(self, group: Group, rank: Rank, message: protocol.Heartbeat) -> None:
        pass

    def rank_ready(self, group: Group, rank: Rank, message: protocol.RankReady) -> None:
        rank.ready = True
        group.rss_ready_mb[rank.rank] = message.rss_mb
        group.rss_mb.setdefault(rank.rank, message.rss_mb)  # shown until its first task
        if (
            group.state == "starting"
            and len(group.ranks) == group.spec.world_size
            and all(r.ready for r in group.ranks.values())
        ):
            group.state = "idle"
            group.ready_at = time.monotonic()
            group.ready_after_s = group.ready_at - group.started_at
            group.last_used = time.monotonic()
            self.totals.group_start_s += group.ready_after_s
            log.info(
                "group %s (%s) ready in %.2fs", group.id, group.spec.label(), group.ready_after_s
            )
            self._schedule()

    def rank_done(self, group: Group, rank: Rank, message: protocol.RankDone) -> None:
        group.rss_mb[rank.rank] = message.rss_mb
        group.cuda_mb[rank.rank] = message.cuda_mb
        group.cuda_reserved_mb[rank.rank] = message.cuda_reserved_mb
        if message.unfit:
            group.unfit[rank.rank] = message.unfit
        task = group.task
        if task is None or task.submit.task_id != message.task_id or group.state != "busy":
            return  # a late report for a task already decided
        result = message.result
        result.rank = rank.rank
        task.results[rank.rank] = result
        if len(task.results) == group.spec.world_size:
            self._complete(task)
        elif result.outcome == "failed" and task.grace_until is None:
            task.grace_until = time.monotonic() + self.config.failure_grace_s

    def rank_stacks(self, group: Group, rank: Rank, message: protocol.RankStacks) -> None:
        task = group.task
        if task is None or task.submit.task_id != message.task_id or task.stacks_until is None:
            return
        task.stacks[rank.rank] = message.stacks
        if set(task.stacks) >= self._stack_ranks(task):
            self._stacks_collected(task)

    # ---- scheduling

    def _schedule(self) -> None:
        if self.stopping:
            return
        for spec in self.queues.waiting_specs():
            while self.queues.depth(spec):
                group = self._idle_group(spec)
                if group is None:
                    break
                task = self.queues.pop(spec)
                assert task is not None
                self._dispatch(task, group)
            if self.queues.depth(spec) and self._should_grow(spec):
                live = any(g.spec == spec and g.state != "stopping" for g in self.groups.values())
                self._start_group(spec, evict=not live)

    def _should_grow(self, spec: PoolSpec) -> bool:
        """Start another group of ``spec`` for its queued tasks?

        Always when it has none. Otherwise only when none is already starting and the oldest
        task has waited ``scale_up_after_s``: a warm group clears a queue of fast tests in
        milliseconds, far sooner than a new group could start, so extra groups are for
        queues that stay long (slow tests, many concurrent clients). The pytest plugin's
        warm-up asks for one group per xdist worker up front, which covers the common case.
        """
        live = [g for g in self.groups.values() if g.spec == spec and g.state != "stopping"]
        if not live:
            return True
        if any(g.state == "starting" for g in live):
            return False
        # Waiting counts from when the pool could first have served: time spent waiting for
        # the pool's own start says nothing about whether it keeps up.
        since = max(self.queues.by_spec[spec].oldest(), max(g.ready_at for g in live))
        return time.monotonic() - since >= self.config.scale_up_after_s

    def _idle_group(self, spec: PoolSpec) -> Group | None:
        idle = [g for g in self.groups.values() if g.spec == spec and g.state == "idle"]
        return max(idle, key=lambda g: g.last_used) if idle else None

    def _start_group(self, spec: PoolSpec, evict: bool = False) -> Group | None:
        gpus = self.resources.allocate(spec)
        if gpus is None:
            if evict:
                self._evict_for(spec)
            return None
        self._group_seq += 1
        group_id = f"g{self._group_seq}"
        process = GroupProcess(
            group_id,
            spec,
            self.resources.backend_for(spec),
            gpus,
            self.backend_endpoint,
            self.config.heartbeat_s,
            self.config.liveness,
            self.config.log_dir,
        )
        group = Group(group_id, spec, process)
        self.groups[group_id] = group
        self.totals.groups_started += 1
        try:
            process.start()
        except OSError as exc:
            self._group_failed(group, f"could not start torchrun: {exc}")
            return None
        log.info(
            "starting group %s (%s) GPUs=%s pid=%s",
            group_id,
            spec.label(),
            gpus or "-",
            process.pid,
        )
        return group

    def _evict_for(self, spec: PoolSpec) -> None:
        """Stop least-recently-used idle groups of other specs if that makes ``spec`` fit."""
        if any(g.state == "stopping" for g in self.groups.values()):
            return  # resources are already on their way back; wait for them
        candidates = sorted(
            (g for g in self.groups.values() if g.state == "idle" and g.spec != spec),
            key=lambda g: (self.queues.depth(g.spec) > 0, g.last_used),
        )
        victims: list[Group] = []
        for group in candidates:
            victims.append(group)
            freed = [(v.spec, v.process.gpus) for v in victims]
            if self.resources.would_fit_after_freeing(spec, freed):
                for victim in victims:
                    log.info(
                        "evicting idle group %s (%s) for %s",
                        victim.id,
                        victim.spec.label(),
                        spec.label(),
                    )
                    self._stop_group(victim, f"evicted for {spec.label()}")
                return

    def _dispatch(self, task: Task, group: Group) -> None:
        now = time.monotonic()
        group.state = "busy"
        group.task = task
        task.group = group
        task.last_group_id = group.id
        task.started_at = now
        task.deadline = now + task.timeout_s
        task.results.clear()
        run = protocol.RunTask(
            task_id=task.submit.task_id,
            target=task.submit.target,
            kwargs=task.submit.kwargs,
            seed=task.submit.seed,
            test_id=task.submit.test_id,
        )
        frame = protocol.encode(run)
        for rank in group.ranks.values():
            if not self._send_rank(rank, frame):
                self._group_failed(group, f"rank {rank.rank} is unreachable")
                return

    # ---- verdicts

    def _complete(self, task: Task) -> None:
        """Every rank reported: aggregate per DESIGN.md's table."""
        group = task.group
        assert group is not None
        results = [task.results[r] for r in sorted(task.results)]
        outcomes = {r.outcome for r in results}
        message = ""
        if "failed" in outcomes:
            outcome = "failed"
        elif outcomes == {"skipped"}:
            outcome = "skipped"
            message = results[0].error.message if results[0].error else ""
        elif "skipped" in outcomes:
            outcome = "failed"
            skipped = [r.rank for r in results if r.outcome == "skipped"]
            message = (
                f"rank(s) {skipped} skipped while the others ran; a skip must be taken on every "
                "rank (call pytest.skip before any rank-dependent branch)"
            )
        else:
            outcome = "passed"
        self._finish(task, outcome, message=message, ranks=results)  # the verdict goes first
        self._release_group(group)

    def _stack_ranks(self, task: Task) -> set[int]:
        assert task.group is not None
        if task.stacks_reason == "deadline":
            return set(task.group.ranks)
        return set(task.group.ranks) - set(task.results)

    def _collect_stacks(self, task: Task, reason: str) -> None:
        assert task.group is not None
        task.stacks_reason = reason
        task.stacks_until = time.monotonic() + self.config.stack_wait_s
        frame = protocol.encode(protocol.DumpStacks(task_id=task.submit.task_id))
        for rank_no in self._stack_ranks(task):
            self._send_rank(task.group.ranks[rank_no], frame)

    def _stacks_collected(self, task: Task) -> None:
        group = task.group
        assert group is not None
        task.stacks_until = None
        stacks = "\n".join(
            f"--- rank {r} ---\n{task.stacks.get(r, '(no answer: the rank is not responding)')}"
            for r in sorted(self._stack_ranks(task))
        )
        if task.stacks_reason == "deadline":
            learned = f" ({task.deadline_note})" if task.deadline_note else ""
            reason = f"deadline of {timings.fmt_seconds(task.timeout_s)}s{learned} passed"
            self._stop_group(group, reason)
            if task.deadline_note:
                # A learned deadline is an estimate and this run outgrew it: the retry gets
                # the deadline the client asked for (when longer), so a test that is slow
                # today but alive is not killed twice by a guess.
                task.timeout_s = max(task.timeout_s, task.requested_timeout_s)
                task.deadline_note = ""
            self._infra_error(task, f"{reason}; where each rank was:\n{stacks}")
            return
        failed = sorted(r for r, res in task.results.items() if res.outcome == "failed")
        stuck = sorted(self._stack_ranks(task))
        for rank_no in stuck:
            task.results[rank_no] = RankResult(
                rank=rank_no,
                outcome="error",
                error=RankError(
                    "cpq.RankStuck",
                    f"did not finish within {self.config.failure_grace_s:g}s after rank(s) "
                    f"{failed} failed (waiting in a collective?)",
                    task.stacks.get(rank_no, ""),
                ),
            )
        self._stop_group(group, f"rank(s) {stuck} stuck after a peer failed")
        self._finish(
            task,
            "failed",
            message=f"rank(s) {failed} failed; rank(s) {stuck} were stuck; the group was recycled",
            ranks=[task.results[r] for r in sorted(task.results)],
        )

    def _infra_error(self, task: Task, detail: str) -> None:
        """An infrastructure failure: retry once on a fresh group, then report ``error``.

        ``detail``'s first line is the reason; the rest (rank stacks, say) goes into the
        retry note too, so a retry that passes still shows where attempt 1 hung.
        """
        reason = detail.splitlines()[0]
        task.group = None
        task.results.clear()
        task.grace_until = task.stacks_until = None
        task.stacks.clear()
        if task.orphaned:
            self._finish(task, "error", message=detail)
            return
        if task.attempts == 1:
            task.attempts = 2
            task.notes.append(
                f"{protocol.RETRY_NOTE} attempt 1: {detail}\n(retried on a fresh group)"
            )
            self.totals.retries += 1
            log.info("retrying %s: %s", task.submit.target, reason)
            task.queued_at = time.monotonic()
            self.queues.push(task, front=True)
            self._schedule()
        else:
            task.notes.append(f"{protocol.RETRY_FAIL_NOTE} attempt 2: {reason}")
            self._finish(task, "error", message=detail)

    def _finish(
        self,
        task: Task,
        outcome: str,
        message: str = "",
        ranks: list[RankResult] | None = None,
    ) -> None:
        now = time.monotonic()
        self.tasks.pop(task.key, None)
        client = self.clients.get(task.client)
        if client is not None:
            client.in_flight.discard(task.key)
        counter = outcome if outcome in ("passed", "failed", "skipped") else "errors"
        setattr(self.totals, counter, getattr(self.totals, counter) + 1)
        result = TaskResult(
            task_id=task.submit.task_id,
            outcome=outcome,
            ranks=ranks or [],
            notes=task.notes,
            message=message,
            group_id=task.group.id if task.group else "",
            attempts=task.attempts,
            duration_s=(now - task.started_at) if task.started_at else 0.0,
            queue_s=(task.started_at or now) - task.first_queued_at,
            deadline_s=task.timeout_s,
        )
        if task.started_at or task.attempts > 1:  # it ran, or tried to (not: rejected, cancelled)
            self._record(task, result)
        if not task.orphaned and client is not None:
            try:
                self._send_client(task.client, protocol.Done(result))
            except protocol.EncodeError as exc:
                result.ranks = []
                result.outcome, result.message = "error", f"result could not be encoded: {exc}"
                self._send_client(task.client, protocol.Done(result))

    def _record(self, task: Task, result: TaskResult) -> None:
        """Append the task to the timing history and learn from it; never raises."""
        timing = timings.TaskTiming(
            finished_at=time.time(),
            target=task.submit.target,
            test_id=task.submit.test_id,
            spec=task.spec.label(),
            world_size=task.spec.world_size,
            outcome=result.outcome,
            duration_s=result.duration_s,
            queue_s=result.queue_s,
            attempts=task.attempts,
            retries=task.attempts - 1,
            group_id=task.last_group_id,
            deadline_s=task.timeout_s,
        )
        self.history.add(timing)
        self.timings.append(timing)
        self.totals.timings_write_errors = self.timings.errors

    # ---- groups

    def _release_group(self, group: Group) -> None:
        """A group finished its task cleanly: back to idle, or recycled (see below)."""
        group.task = None
        group.tasks_done += 1
        group.last_used = time.monotonic()
        group.state = "idle"
        reason = self._recycle_reason(group)
        if reason:
            self.totals.groups_recycled += 1
            self._stop_group(group, reason)
        self._schedule()

    def _recycle_reason(self, group: Group) -> str:
        """Why a group that just finished a task cleanly must not serve another ("": it may).

        Long-lived ranks accumulate what tests leave behind (caches, leaked tensors,
        fragmented allocators); a fresh group after N tasks or after a memory bound keeps
        that from turning into out-of-memory failures in unrelated later tests.
        """
        limit = self.config.max_tasks_per_group
        if limit and group.tasks_done >= limit:
            return f"recycled after {group.tasks_done} tasks"
        for rank_no, why in sorted(group.unfit.items()):
            return f"recycled: rank {rank_no} {why}"
        bound = self.config.max_rss_growth_mb
        if bound:
            for rank_no, rss in sorted(group.rss_mb.items()):
                base = group.rss_ready_mb.get(rank_no, 0.0)
                if base > 0 and rss - base > bound:  # 0: a rank that reported no baseline
                    return (
                        f"recycled: rank {rank_no} RSS grew {rss - base:.0f} MB since ready "
                        f"(--max-rss-growth {bound:g})"
                    )
        return ""

    def _stop_group(self, group: Group, reason: str) -> None:
        if group.state == "stopping":
            return
        log.info("stopping group %s (%s): %s", group.id, group.spec.label(), reason)
        group.state = "stopping"
        group.stop_reason = reason
        group.task = None
        shutdown = protocol.encode(protocol.Shutdown())
        for rank in group.ranks.values():
            self._send_rank(rank, shutdown)
            self.ranks.pop(rank.identity, None)
        group.process.terminate(self.config.kill_grace_s)

    def _group_failed(self, group: Group, reason: str) -> None:
        """A rank died, went silent, or the group never came up."""
        if group.state == "stopping":
            return
        was_starting = group.state == "starting"
        task = group.task
        self.totals.groups_failed += 1
        tail = group.process.log_tail()
        self._stop_group(group, reason)
        log.warning("group %s failed: %s", group.id, reason)
        if task is not None:
            self._infra_error(task, f"{reason} (group {group.id})")
        elif was_starting:
            self._start_failed(group.spec, f"group {group.id} could not start: {reason}", tail)

    def _start_failed(self, spec: PoolSpec, reason: str, log_tail: str) -> None:
        """No group of ``spec`` came up: queued tasks get one more try, then an error."""
        if any(g.spec == spec and g.state in ("starting", "idle") for g in self.groups.values()):
            return  # another group of this spec may still serve them
        detail = f"{reason}\n--- end of the group's log ---\n{log_tail}"
        for task in self.queues.remove(lambda t: t.spec == spec):
            if task.attempts == 1:
                task.attempts = 2
                task.notes.append(
                    f"{protocol.RETRY_NOTE} attempt 1: {reason}; retried on a fresh group"
                )
                self.totals.retries += 1
                self.queues.push(task)
            else:
                task.notes.append(f"{protocol.RETRY_FAIL_NOTE} attempt 2: {reason}")
                self._finish(task, "error", message=detail)

    # ---- time

    def tick(self, now: float) -> None:
        self._flush_outbox()
        if now - self._last_heartbeat >= self.config.heartbeat_s:
            self._last_heartbeat = now
            self._send_heartbeats()
        silence = self.config.heartbeat_s * self.config.liveness
        for client in list(self.clients.values()):
            if self._silent_for(client, client.local_pid(), now) > silence:
                self._drop_client(client, f"silent for {now - client.last_seen:.1f}s")
        for group in list(self.groups.values()):
            self._tick_group(group, now, silence)
        if self.queues:
            self._schedule()  # queued tasks may have waited long enough to grow a pool
        if self.draining and not self.tasks:
            self._stop_now("drained")
        if self.tasks or self.clients:
            self.idle_since = now
        elif self.config.idle_exit_s and now - self.idle_since > self.config.idle_exit_s:
            log.info("idle for %.0fs; exiting", now - self.idle_since)
            self._stop_now("idle")

    def _tick_group(self, group: Group, now: float, silence: float) -> None:
        if group.state == "stopping":
            if group.process.reap():
                self.resources.release(group.spec, group.process.gpus)
                del self.groups[group.id]
                self._schedule()
            return
        code = group.process.exit_code()
        if code is not None:
            self._group_failed(group, f"torchrun exited with status {code} (a rank died?)")
            return
        # A rank with work is watched for CPU progress; its deadline (or the start time-out)
        # bounds it. An idle rank runs no user code: silence alone counts.
        working = group.task is not None or group.state == "starting"
        for rank in group.ranks.values():
            if self._silent_for(rank, rank.pid if working else None, now, group) > silence:
                self._group_failed(
                    group, f"rank {rank.rank} stopped heartbeating ({now - rank.last_seen:.1f}s)"
                )
                return
        if group.state == "starting" and now - group.started_at > self.config.start_timeout_s:
            self._group_failed(group, f"not ready after {self.config.start_timeout_s:g}s")
            return
        task = group.task
        if task is None:
            return
        if task.stacks_until is not None:
            if now >= task.stacks_until:
                self._stacks_collected(task)
        elif now >= task.deadline:
            self._collect_stacks(task, "deadline")
        elif task.grace_until is not None and now >= task.grace_until:
            self._collect_stacks(task, "peer_failed")

    def _silent_for(
        self, peer: Client | Rank, pid: int | None, now: float, group: Group | None = None
    ) -> float:
        """How long a peer has shown no sign of life (see :mod:`cpq.liveness`): ``pid`` is
        the process to watch for CPU progress once it is quiet, or None for silence alone."""
        watch = peer.busy_watch
        was_busy = watch.busy
        quiet = watch.quiet_for(now, peer.last_seen, pid, self.config.heartbeat_s * 1.5)
        if watch.busy and not was_busy:
            self.totals.busy_silences += 1
            if isinstance(peer, Client):
                label = f"client {peer.info.get('name') or peer.identity.hex()}"
            else:
                label = f"rank {peer.rank} of group {group.id if group else '?'}"
            log.warning(
                "%s silent for %.1fs but computing (holding the GIL in native code?): "
                "busy, not dead",
                label,
                now - peer.last_seen,
            )
        return quiet

    def _send_heartbeats(self) -> None:
        for identity, client in list(self.clients.items()):
            if client.greeted:
                self._send_client(identity, self._heartbeat)
        for _, rank in list(self.ranks.values()):
            self._send_rank(rank, self._heartbeat)

    def _drop_client(self, client: Client, why: str) -> None:
        self.clients.pop(client.identity, None)
        dropped = self.queues.remove(lambda t: t.client == client.identity)
        for task in dropped:
            self.tasks.pop(task.key, None)
        for key in client.in_flight:
            task = self.tasks.get(key)
            if task is not None:
                task.orphaned = True
        if dropped or client.in_flight:
            log.info(
                "client %s %s: dropped %d queued task(s)", client.identity.hex(), why, len(dropped)
            )

    def _stop_now(self, why: str) -> None:
        for task in list(self.tasks.values()):
            self._finish(task, "error", message=f"the broker stopped: {why}")
        self._flush_outbox()
        self.stopping = True

    # ---- sending

    def _send_client(self, identity: bytes, message: protocol.Message | bytes) -> None:
        frame = message if isinstance(message, bytes) else protocol.encode(message)
        try:
            self.frontend.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:
            self._outbox.append((identity, frame))
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                client = self.clients.get(identity)
                if client is not None:
                    self._drop_client(client, "is gone")
            else:
                raise

    def _flush_outbox(self) -> None:
        pending, self._outbox = self._outbox, []
        for identity, frame in pending:
            self._send_client(identity, frame)

    def _send_rank(self, rank: Rank, frame: bytes) -> bool:
        try:
            self.backend.send_multipart([rank.identity, frame], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, errno.EAGAIN):
                return False
            raise

    # ---- status

    def describe(self) -> dict[str, Any]:
        return snapshot.describe(self)

    def status(self) -> dict[str, Any]:
        return snapshot.status(self)


# --------------------------------------------------------------------------- running


def detect_gpus(requested: str) -> list[str]:
    """``--gpus``: ``auto`` (CUDA_VISIBLE_DEVICES, else nvidia-smi), ``none``, or a list."""
    if requested == "none":
        return []
    if requested != "auto":
        return [g.strip() for g in requested.split(",") if g.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=20, check=True
        )
    except (subprocess.SubprocessError, OSError):
        return []
    return [str(i) for i, line in enumerate(listing.stdout.splitlines()) if line.startswith("GPU ")]


def run_broker(config: BrokerConfig) -> None:
    broker = Broker(config)
    broker.bind()
    broker.warm_up()

    def _on_signal(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        broker._stop_now(f"signal {signum}")

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        broker.serve()
    finally:
        broker.close()


def new_task_id() -> str:
    return uuid.uuid4().hex
