"""The client's one DEALER socket, shared by the caller's thread and a background thread.

Whoever waits holds the socket (docs/design.md, "Dispatch"). A caller in
:meth:`cpq.Client.submit` sends its task and reads the verdict itself, so a test's task
costs no hand-off between threads in the client. The background thread holds the socket
only when nobody else does and something must be done: it heartbeats on its tick (also while
the caller runs other code between tests), resolves the futures of :meth:`Client.submit_async`
and of control requests, and notices a silent broker.

Holding is a lock. A thread that wants the socket while another holds it writes a byte to a
wake-up pipe the holder polls: the background thread then lets go, and a caller holding it
sends what waits in the outbox. ZeroMQ sockets may change threads behind a full memory
barrier, which the lock provides.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from cpq import protocol
from cpq.spin import Spinner

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class SharedSocket:
    """A DEALER connected to the broker, and the rules for holding it (module docstring).

    ``on_frame`` is called with every frame from the broker, by whichever thread holds the
    socket; ``on_silence`` when the broker has been silent past ``heartbeat_s x liveness``
    (only once :attr:`watching`: before the welcome, the connect time-out counts).
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        on_frame: Callable[[bytes], bool],
        on_silence: Callable[[float], None],
        heartbeat_s: float,
        liveness: int,
    ) -> None:
        from cpq import security  # local: only clients of tcp endpoints need keys

        self.dealer = context.socket(zmq.DEALER)
        try:
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
            security.configure_client(self.dealer, endpoint)
            self.dealer.connect(endpoint)  # a malformed endpoint raises here
        except BaseException:
            self.dealer.close(0)
            raise
        self.on_frame = on_frame
        self.on_silence = on_silence
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.watching = False
        self.lock = threading.Lock()
        self.outbox: deque[bytes] = deque()
        self.wanted = 0  # callers waiting for the socket: the background thread stands back
        self._wanted_lock = threading.Lock()  # += is not atomic across threads
        self.kicked = threading.Event()  # wakes the background thread before its tick
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller = zmq.Poller()
        self.poller.register(self.dealer, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        #: A caller's wait for its answer spins a moment first (cpq.spin).
        self.spinner = Spinner()
        self.last_heard = self.last_sent = time.monotonic()
        self._heartbeat = protocol.encode(protocol.Heartbeat())

    @property
    def tick_s(self) -> float:
        return min(0.25, self.heartbeat_s / 4)

    # ---- any thread

    def send(self, frame: bytes) -> bool:
        """Send ``frame`` now if the socket is free, else through the holder's outbox.
        True when it went out now (nobody holds the socket to read the answer)."""
        self.outbox.append(frame)  # first: a holder letting go looks at the outbox after
        if self.lock.acquire(blocking=False):
            try:
                self.flush()
            finally:
                self.release()
            return True
        self.wake()
        return False

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe already says it
            os.write(self._wake_w, b"w")

    def take(self, timeout_s: float) -> bool:
        """Hold the socket, waking its holder; False after ``timeout_s`` (another caller's
        thread holds it, and reads for everyone)."""
        if self.lock.acquire(blocking=False):
            return True
        with self._wanted_lock:
            self.wanted += 1
        try:
            self.wake()
            return self.lock.acquire(timeout=timeout_s)
        finally:
            with self._wanted_lock:
                self.wanted -= 1

    def release(self) -> None:
        self.lock.release()
        if self.outbox:  # queued after the holder's last flush: the background thread sends
            self.kicked.set()

    # ---- the holder only

    def flush(self) -> None:
        while self.outbox:
            # Sent, then removed: a frame interrupted before it went out stays first in line
            # (a later env_same must not overtake the variables it refers to). Never blocking:
            # a DEALER with no peer (a CURVE handshake the broker refused drops the pipe)
            # blocks a send for ever, where the caller's own time-out must say "no answer";
            # the frame waits for the next flush (every pump, a tick at most).
            try:
                self.dealer.send(self.outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self.outbox.popleft()
            self.last_sent = time.monotonic()

    def pump(self, timeout_ms: int, spin: bool = False) -> None:
        """Poll once (``spin``: through :attr:`spinner`, for a caller waiting for its
        answer): send the outbox, hand the broker's frames to ``on_frame``, heartbeat when
        due, report a silent broker."""
        if spin:
            events = dict(self.spinner.poll(self.poller, timeout_ms))
        else:
            events = dict(self.poller.poll(timeout=timeout_ms))
        if self._wake_r in events:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 64):
                    pass
        self.flush()
        now = time.monotonic()
        while int(self.dealer.getsockopt(_EVENTS)) & _POLLIN:
            if self.on_frame(self.dealer.recv()):  # junk is no sign of a live broker
                self.last_heard = now
        if now - self.last_sent >= self.heartbeat_s:
            with contextlib.suppress(zmq.Again):  # no broker connected, no heartbeat
                self.dealer.send(self._heartbeat, zmq.NOBLOCK)
            self.last_sent = now
        silent = now - self.last_heard
        # Frames that arrived while this thread waited for the GIL are signs of life.
        if self.watching and silent > self.heartbeat_s * self.liveness and not self.dealer.poll(0):
            self.on_silence(silent)

    def serve(self, busy: Callable[[], bool], closed: threading.Event) -> None:
        """The background thread: hold the socket while ``busy()`` (futures nobody else
        reads) and for a moment every tick (heartbeats), never while a caller wants it."""
        while not closed.is_set():
            self.kicked.wait(self.tick_s)
            self.kicked.clear()
            if self.wanted or not self.lock.acquire(blocking=False):
                continue
            try:
                self.pump(0)
                while busy() and not self.wanted and not closed.is_set():
                    self.pump(int(self.tick_s * 1000))
            finally:
                self.release()

    def close(self, goodbye: bytes, say: bool = True) -> bool:
        """Say goodbye (never blocking: with no broker connected a send would wait) and close.
        False when another thread still holds the socket: it is then left open (closing a
        ZeroMQ socket under another thread's poll is not allowed), to be freed with the
        process."""
        if not self.take(timeout_s=5):
            return False
        try:
            if say:
                self.flush()
                with contextlib.suppress(zmq.Again):
                    self.dealer.send(goodbye, zmq.NOBLOCK)
            self.dealer.close(0)
            os.close(self._wake_r)
            os.close(self._wake_w)
        finally:
            self.lock.release()
        return True
