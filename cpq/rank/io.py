"""A rank's I/O thread: the only thread that talks to the broker.

It owns the ZeroMQ DEALER: it says hello, heartbeats, hands tasks to the main thread
(:mod:`cpq.rank.runtime`) through a queue, answers stack-dump requests by reading the main
thread's frames, and exits the process when the broker goes silent. Because it never waits
on the main thread, a rank stuck in a collective still heartbeats and can still say where
it is stuck; that is why the broker also keeps a per-task deadline.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from cpq import protocol
from cpq.rank import cancel

log = logging.getLogger("cpq.rank")

#: cpq's own frames are left out of the stacks a rank reports.
CPQ_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

EXIT_BROKER_LOST = 75
#: The in-process pipe the main thread sends its reports through (the I/O thread forwards).
PIPE = "inproc://cpq-rank-results"


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


# --------------------------------------------------------------------------- I/O thread


class IOThread(threading.Thread):
    """Owns the DEALER socket; the only thread that talks to the broker."""

    def __init__(self, config: RankConfig, context: zmq.Context[Any]) -> None:
        super().__init__(name="cpq-io", daemon=True)
        self.config = config
        self.context = context
        self.tasks: queue.Queue[protocol.RunTask | None] = queue.Queue()
        self.main_thread_id = threading.main_thread().ident
        self.bound = threading.Event()

    def run(self) -> None:
        cfg = self.config
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
        dealer.connect(cfg.endpoint)
        pipe = self.context.socket(zmq.PAIR)
        pipe.setsockopt(zmq.LINGER, 0)
        pipe.bind(PIPE)
        self.bound.set()
        hello = protocol.RankHello(
            group_id=cfg.group_id,
            token=cfg.token,
            rank=cfg.rank,
            local_rank=cfg.local_rank,
            pid=os.getpid(),
        )
        dealer.send(protocol.encode(hello))
        heartbeat = protocol.encode(protocol.Heartbeat())
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pipe, zmq.POLLIN)
        last_heard = last_sent = time.monotonic()
        silence_limit = cfg.heartbeat_s * cfg.liveness
        while True:
            events = dict(poller.poll(timeout=int(cfg.heartbeat_s * 1000 / 2)))
            now = time.monotonic()
            if dealer in events:
                last_heard = now
                self._on_broker_frame(dealer, dealer.recv())
            if pipe in events:
                dealer.send(pipe.recv())
                last_sent = now
            if now - last_sent >= cfg.heartbeat_s:
                dealer.send(heartbeat)
                last_sent = now
            # Before calling the broker lost, look for frames that arrived while this thread
            # could not run (the task held the GIL): those are the broker's heartbeats.
            if now - last_heard > silence_limit and not dealer.poll(0):
                log.error("broker silent for %.1fs; exiting", now - last_heard)
                hard_exit(EXIT_BROKER_LOST)

    def _on_broker_frame(self, dealer: zmq.Socket[Any], frame: bytes) -> None:
        try:
            message = protocol.decode(frame)
        except protocol.ProtocolError as exc:
            log.error("dropping a malformed frame from the broker: %s", exc)
            return
        if isinstance(message, protocol.RunTask):
            self.tasks.put(message)
        elif isinstance(message, protocol.CancelTask):
            cancel.request(message.task_id, self.main_thread_id)
        elif isinstance(message, protocol.DumpStacks):
            stacks = protocol.RankStacks(
                task_id=message.task_id, rank=self.config.rank, stacks=self.main_stack()
            )
            dealer.send(protocol.encode(stacks))
        elif isinstance(message, protocol.Shutdown):
            self.tasks.put(None)
            # A main thread stuck in a collective never reads the queue: leave anyway.
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


def user_stack(frames: traceback.StackSummary) -> str:
    """The frames after cpq's last one: the user's code, where it is now."""
    cpq_frames = [i for i, f in enumerate(frames) if f.filename.startswith(CPQ_DIR)]
    start = cpq_frames[-1] + 1 if cpq_frames else 0
    return "".join(traceback.format_list(frames[start:])) or "(in cpq's own code)"


def hard_exit(code: int) -> None:
    logging.shutdown()
    os._exit(code)
