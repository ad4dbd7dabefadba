"""The broker's sockets: the endpoint lock, the two ROUTERs, sending, the outbox, closing.

* the **frontend** ROUTER serves clients at the public endpoint (``ipc://`` in a 0700
  directory, or CURVE-secured ``tcp://``, see :mod:`cpq.security`);
* the **backend** ROUTER at ``ipc://<state dir>/backend-<pid>.sock`` serves the ranks of
  this broker's groups.

Knows frames and identities, nothing of clients, tasks or groups: a client that has gone
(``EHOSTUNREACH``) is reported to ``on_client_gone``; a rank that cannot be reached is
reported by :meth:`Transport.send_rank`'s return value. Nothing here blocks: a frame a
client's pipe cannot take now waits in that client's backlog, flushed every tick, and every
later frame to that client waits behind it (a client pairs replies with requests in order:
a verdict or a status reply must never overtake an earlier frame). A client whose backlog
passes :data:`MAX_BACKLOG` frames cannot keep up: it is reported gone (its tasks are
dropped) rather than letting the broker's memory grow without bound.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import zmq

from cpq import __version__, lockfile, protocol, security
from cpq.broker.config import BrokerConfig
from cpq.spin import Spinner

log = logging.getLogger("cpq.broker")


#: Frames one client may have waiting for room in its pipe before it counts as gone. The
#: pipe itself holds 100,000 (SNDHWM); this is what a client that stopped reading costs.
MAX_BACKLOG = 10_000


class BrokerAlreadyRunning(RuntimeError):
    pass


def backend_endpoint_for(state_dir: Path) -> str:
    return f"ipc://{state_dir / f'backend-{os.getpid()}.sock'}"


class Transport:
    """Both ROUTER sockets of one broker (see the module docstring)."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.backend_endpoint = backend_endpoint_for(config.state_dir)
        self.on_client_gone: Callable[[bytes], None] = lambda identity: None
        #: Per client, in order, the frames its pipe had no room for yet.
        self._outbox: dict[bytes, deque[bytes]] = {}
        self._heartbeat = protocol.encode(protocol.Heartbeat())
        self._lock_file: IO[str] | None = None
        self._authenticator: Any = None
        self._context: zmq.Context[Any] | None = None
        self.frontend: zmq.Socket[Any] | None = None
        self.backend: zmq.Socket[Any] | None = None
        self._poller = zmq.Poller()
        self._spinner = Spinner()  # spin, then block (cpq.spin)

    # ---- binding

    def bind(self) -> None:
        """Take the endpoint's lock and bind both ROUTERs (refuses a second broker)."""
        try:
            self._lock_file = lockfile.acquire(self.config.endpoint)
        except lockfile.LockHeld as exc:
            raise BrokerAlreadyRunning(str(exc)) from None
        self._remove_stale_backend_sockets()
        self._context = zmq.Context()
        self.frontend = self._router(self.config.endpoint, public=True)
        self.backend = self._router(self.backend_endpoint)
        self._poller.register(self.frontend, zmq.POLLIN)
        self._poller.register(self.backend, zmq.POLLIN)
        lockfile.mark_serving(self._lock_file)  # spawn_broker returns on this line
        log.info(
            "cpq-broker %s pid %d serving %s (GPUs: %s, max CPU ranks: %d; spinning %d us "
            "after task traffic, cpq.spin)",
            __version__,
            os.getpid(),
            self.config.endpoint,
            ",".join(self.config.gpus) or "none",
            self.config.max_ranks,
            round(self._spinner.window_s * 1e6),
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
        assert self._context is not None
        sock: zmq.Socket[Any] = self._context.socket(zmq.ROUTER)
        if public:
            self._authenticator = security.configure_server(
                self._context, sock, endpoint, self.config.insecure
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

    # ---- receiving

    def poll(self, timeout_s: float) -> tuple[bool, bool]:
        """Wait up to ``timeout_s``; returns (clients have sent, ranks have sent)."""
        events = dict(self._spinner.poll(self._poller, int(timeout_s * 1000)))
        return self.frontend in events, self.backend in events

    def note_activity(self) -> None:
        """Task traffic now: the next poll spins a moment before it blocks (cpq.spin)."""
        self._spinner.note()

    def recv_client(self) -> list[bytes] | None:
        """One waiting client message as ``[identity, *payload frames]``; None if none."""
        return _recv(self.frontend)

    def recv_rank(self) -> list[bytes] | None:
        return _recv(self.backend)

    # ---- sending

    def send_client(self, identity: bytes, message: protocol.Message | bytes) -> None:
        frame = message if isinstance(message, bytes) else protocol.encode(message)
        backlog = self._outbox.get(identity)
        if backlog is not None:  # behind earlier frames: never overtake them
            if frame is not self._heartbeat:  # a backlog delivered is sign of life enough
                backlog.append(frame)
                if len(backlog) > MAX_BACKLOG:
                    self._client_unreachable(identity, f"{len(backlog)} frames it did not read")
            return
        if not self._send_now(identity, frame):
            self._outbox[identity] = deque([frame])

    def _send_now(self, identity: bytes, frame: bytes) -> bool:
        """Send one frame; False when the client's pipe has no room now."""
        assert self.frontend is not None
        try:
            self.frontend.send_multipart([identity, frame], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self._client_unreachable(identity, "unreachable")
                return True  # nothing to keep: the client is gone
            raise

    def _client_unreachable(self, identity: bytes, why: str) -> None:
        dropped = self._outbox.pop(identity, None)
        if dropped:
            log.warning("client %s cannot keep up (%s): dropping it", identity.hex(), why)
        self.on_client_gone(identity)

    def send_rank(self, identity: bytes, frame: bytes) -> bool:
        """False when the rank cannot be reached (gone, or its pipe is full)."""
        assert self.backend is not None
        try:
            self.backend.send_multipart([identity, frame], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, errno.EAGAIN):
                return False
            raise

    def flush_outbox(self) -> None:
        """Send what each client's pipe has room for now, in order."""
        for identity in list(self._outbox):
            backlog = self._outbox.get(identity)
            while backlog and self._send_now(identity, backlog[0]):
                if identity not in self._outbox:
                    break  # it went away while we sent
                backlog.popleft()
            if identity in self._outbox and not backlog:
                del self._outbox[identity]

    def send_heartbeats(self, clients: Iterable[bytes], ranks: Iterable[bytes]) -> None:
        for identity in list(clients):
            self.send_client(identity, self._heartbeat)
        for identity in list(ranks):
            self.send_rank(identity, self._heartbeat)

    # ---- closing

    def close(self) -> None:
        for sock in (self.frontend, self.backend):
            if sock is not None:
                sock.close(0)
        for endpoint in (self.config.endpoint, self.backend_endpoint):
            if endpoint.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(endpoint[len("ipc://") :])
        if self._authenticator is not None:
            self._authenticator.stop()
        if self._lock_file is not None:
            self._lock_file.close()


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: no enum per call


def _recv(sock: zmq.Socket[Any] | None) -> list[bytes] | None:
    # Asking the socket first is cheaper than the zmq.Again a NOBLOCK receive raises when
    # nothing is waiting (every drain of the event loop ends with that question).
    if sock is None or not int(sock.getsockopt(_EVENTS)) & _POLLIN:
        return None
    try:
        return sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None
