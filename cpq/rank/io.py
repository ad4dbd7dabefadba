"""A rank's link to the broker: one DEALER socket that two threads take turns holding.

Whoever waits holds the socket (docs/design.md, "Dispatch"). The main thread holds it while
it waits for work: it polls the broker itself, runs a task the moment it arrives and sends
the report itself, so a task costs no thread hand-off on the rank. While the main thread is
busy (starting up, or in a task longer than a watchdog tick) the :class:`Watchdog` thread
holds it instead: it heartbeats, answers stack dumps, delivers cancels and exits the process
when the broker goes silent. Because the watchdog never waits on the main thread, a rank
stuck in a collective still heartbeats and can still say where it is stuck; that is why the
broker also keeps a per-task deadline.

The hand-over is a lock plus a wake-up pipe: the main thread takes a free lock without
waking anybody (the usual case: short tasks end before the watchdog's next tick); when the
watchdog holds it, the main thread writes one byte to the pipe the watchdog polls, and the
watchdog lets go. ZeroMQ sockets may change threads behind a full memory barrier, which the
lock provides.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from cpq import protocol, tracepoints
from cpq.rank import cancel, items
from cpq.spin import Spinner

log = logging.getLogger("cpq.rank")

#: cpq's own frames are left out of the stacks a rank reports.
CPQ_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

EXIT_BROKER_LOST = 75


@dataclass(frozen=True)
class RankConfig:
    endpoint: str
    group_id: str
    token: str
    rank: int
    local_rank: int
    world_size: int
    dist_backend: str
    heartbeat_s: float
    liveness: int
    roots: list[str]
    log_dir: str

    @classmethod
    def from_env(cls) -> RankConfig:
        env = os.environ
        return cls(
            endpoint=env["CPQ_BACKEND_ENDPOINT"],
            group_id=env["CPQ_GROUP_ID"],
            token=env["CPQ_GROUP_TOKEN"],
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            world_size=int(env["WORLD_SIZE"]),
            dist_backend=env.get("CPQ_DIST_BACKEND", "gloo"),
            heartbeat_s=float(env.get("CPQ_HEARTBEAT_S", "1")),
            liveness=int(env.get("CPQ_LIVENESS", "5")),
            roots=[r for r in env.get("CPQ_ROOTS", "").split(os.pathsep) if r],
            log_dir=env.get("CPQ_LOG_DIR", ""),
        )


class Link:
    """The DEALER to the broker and the rules for holding it (see the module docstring).

    Every method that touches the socket must be called by the thread holding :attr:`lock`.
    """

    def __init__(self, config: RankConfig, context: zmq.Context[Any]) -> None:
        self.config = config
        self.dealer = context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
        self.dealer.connect(config.endpoint)
        self.lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.poller = zmq.Poller()
        self.poller.register(self.dealer, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        #: The main thread's wait for its next task spins a moment first (cpq.spin).
        self.spinner = Spinner()
        self.main_thread_id = threading.main_thread().ident
        self.tasks: deque[protocol.RunTask] = deque()  # arrived while the watchdog held it
        #: The post-mortem relay's frames (``cpq.rank.pdb_relay``), in order of arrival.
        self.debug: deque[protocol.DebugAttach | protocol.DebugLine] = deque()
        self.shutting_down = False
        #: Bumped by the main thread when it starts a task; the watchdog takes the socket
        #: only from a task it saw at two ticks in a row (a short task never wakes it).
        self.task_seq = 0
        self.busy = True  # the main thread starts busy: init, preloads
        self.last_heard = self.last_sent = time.monotonic()
        self._heartbeat = protocol.encode(protocol.Heartbeat())
        #: Called by the main thread between its polls while it waits for a task (idle).
        self.on_idle: Callable[[], None] | None = None
        #: What the running task printed so far (set by the runtime: its fd capture).
        self.output_so_far: Callable[[], tuple[str, str]] | None = None
        #: Frames from the broker that were junk (see :meth:`_on_broker_frame`).
        self.malformed = 0
        #: The kinds a broker sends a rank, each to its handler (docs/design.md "Wire").
        self._handlers: dict[type[protocol.Message], Callable[[Any], None]] = {
            protocol.RunTask: self._on_run_task,
            protocol.CancelTask: self._on_cancel,
            protocol.DumpStacks: self._on_dump_stacks,
            protocol.Shutdown: self._on_shutdown,
            protocol.Heartbeat: lambda message: None,  # its arrival is the point
            protocol.DebugAttach: self.debug.append,  # the post-mortem relay's, in order
            protocol.DebugLine: self.debug.append,
        }

    # ---- the main thread's side

    def take(self) -> None:
        """Hold the socket (main thread): free at once, or after waking the watchdog."""
        if not self.lock.acquire(blocking=False):
            os.write(self._wake_w, b"w")
            self.lock.acquire()
        self.busy = False

    def give(self) -> None:
        """Let go of the socket before a task (main thread)."""
        self.task_seq += 1
        self.busy = True
        self.lock.release()

    def next_task(self) -> protocol.RunTask | None:
        """Wait for the broker's next task while holding the socket; ``None``: shut down.
        Called just after a report: the next task is likely to come soon, so the first
        moment of the wait spins (:mod:`cpq.spin`)."""
        self.spinner.note()
        while not self.tasks:
            if self.shutting_down:
                return None
            self.pump(int(self.config.heartbeat_s * 500), spin=True)
            if self.on_idle is not None and not self.tasks:
                self.on_idle()
        return self.tasks.popleft()

    def next_debug(self, task_id: str) -> protocol.DebugAttach | None:
        """Wait for the broker's word on ``task_id``'s post-mortem; ``None``: shut down, or
        the broker moved on (it sent the next task: the verdict held no post-mortem)."""
        while not self.shutting_down and not self.tasks:
            while self.debug:
                message = self.debug.popleft()
                if isinstance(message, protocol.DebugAttach) and message.task_id == task_id:
                    return message
            self.pump(int(self.config.heartbeat_s * 500))
        return None

    def next_debug_line(self, task_id: str) -> protocol.DebugLine | None:
        """Wait for the user's next line at the debugger; ``None``: given up or shut down."""
        while not self.shutting_down:
            while self.debug:
                message = self.debug.popleft()
                if message.task_id != task_id:
                    continue
                if isinstance(message, protocol.DebugLine):
                    return message
                if not message.start:  # the client gave the session up
                    return None
            self.pump(int(self.config.heartbeat_s * 500))
        return None

    # ---- either side, holding the lock

    def send(self, frame: bytes) -> None:
        self.dealer.send(frame)
        self.last_sent = time.monotonic()

    def pump(self, timeout_ms: int, spin: bool = False) -> bool:
        """Poll once (``spin``: through :attr:`spinner`; the main thread's only): handle
        what the broker sent, heartbeat when due, give up on a silent broker. Returns True
        when the wake-up pipe was written (the other thread wants in)."""
        if spin:
            events = dict(self.spinner.poll(self.poller, timeout_ms))
        else:
            events = dict(self.poller.poll(timeout=timeout_ms))
        now = time.monotonic()
        woken = self._wake_r in events
        if woken:
            while True:
                try:
                    if not os.read(self._wake_r, 64):
                        break
                except BlockingIOError:
                    break
        if self.dealer in events:
            while self.dealer.poll(0):
                if self._on_broker_frame(self.dealer.recv()):  # junk is no sign of life
                    self.last_heard = now
        if now - self.last_sent >= self.config.heartbeat_s:
            self.send(self._heartbeat)
        # Before calling the broker lost, look for frames that arrived while this thread
        # could not run (the task held the GIL): those are the broker's heartbeats.
        silence = now - self.last_heard
        if silence > self.config.heartbeat_s * self.config.liveness and not self.dealer.poll(0):
            log.error("broker silent for %.1fs; exiting", silence)
            hard_exit(EXIT_BROKER_LOST)
        return woken

    def _on_broker_frame(self, frame: bytes) -> bool:
        """Handle one frame by its kind's handler; False for junk, which is counted in
        ``malformed``, logged, and no sign of a live broker."""
        junk = protocol.dispatch(frame, self._handlers)
        if junk:
            self.malformed += 1
            log.error("dropping from the broker %s", junk)
        return not junk

    def _on_run_task(self, message: protocol.RunTask) -> None:
        self.tasks.append(message)

    def _on_cancel(self, message: protocol.CancelTask) -> None:
        cancel.request(message.task_id, self.main_thread_id)

    def _on_dump_stacks(self, message: protocol.DumpStacks) -> None:
        stdout, stderr = self.output_so_far() if self.output_so_far is not None else ("", "")
        stacks = protocol.RankStacks(
            task_id=message.task_id,
            rank=self.config.rank,
            stacks=self.main_stack(),
            phase=items.phase if cancel.current() else "",
            stdout=stdout,
            stderr=stderr,
        )
        features = frozenset(os.environ.get(protocol.FEATURES_ENV, "").split(","))
        self.send(protocol.encode_for(stacks, features))  # the broker's features only

    def _on_shutdown(self, message: protocol.Shutdown) -> None:
        self.shutting_down = True
        if self.busy:  # a main thread stuck in a collective never looks: leave anyway
            threading.Timer(self.config.heartbeat_s * 2, hard_exit, args=(0,)).start()

    def main_stack(self) -> str:
        """Where the main thread is in the user's code: the frames below cpq's own (the
        runtime and the pytest-task loader are noise in a hang report)."""
        frame = sys._current_frames().get(self.main_thread_id or -1)
        if frame is None:
            return "(main thread not found)"
        if not cancel.current():
            return "(not in the task: its part was done)"
        return user_stack(traceback.extract_stack(frame))


class Watchdog(threading.Thread):
    """Holds the link while the main thread cannot: at start-up, and in long tasks."""

    def __init__(self, link: Link) -> None:
        super().__init__(name="cpq-watchdog", daemon=True)
        self.link = link
        self.tick_s = min(0.25, link.config.heartbeat_s / 4)
        link.lock.acquire()  # held from the start: the main thread is busy starting up

    def run(self) -> None:
        link, cfg = self.link, self.link.config
        hello = protocol.RankHello(
            group_id=cfg.group_id,
            token=cfg.token,
            rank=cfg.rank,
            local_rank=cfg.local_rank,
            pid=os.getpid(),
        )
        link.send(protocol.encode(hello))
        self._hold()
        seen = -1
        while True:
            time.sleep(self.tick_s)
            seq = link.task_seq
            if link.busy and seq == seen and link.lock.acquire(blocking=False):
                self._hold()
            seen = seq

    def _hold(self) -> None:
        """Serve the socket until the main thread asks for it back, then let go."""
        try:
            while not self.link.pump(int(self.tick_s * 1000)):
                pass
        finally:
            self.link.lock.release()


def user_stack(frames: traceback.StackSummary) -> str:
    """The frames after cpq's last one and the test harness's (pytest and pluggy calling a
    test or a fixture) that follow it: the user's code, where it is now."""
    cpq_frames = [i for i, f in enumerate(frames) if f.filename.startswith(CPQ_DIR)]
    start = cpq_frames[-1] + 1 if cpq_frames else 0
    harness = _harness_dirs()
    user = start
    while user < len(frames) and harness and frames[user].filename.startswith(harness):
        user += 1
    shown = frames[user:] if user < len(frames) else frames[start:]
    return "".join(traceback.format_list(shown)) or "(in cpq's own code)"


def _harness_dirs() -> tuple[str, ...]:
    """pytest's and pluggy's folders, where they are loaded (never imported here)."""
    dirs = []
    for name in ("_pytest", "pluggy"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(path, str):
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def hard_exit(code: int) -> None:
    tracepoints.flush()  # os._exit runs no atexit
    logging.shutdown()
    os._exit(code)
