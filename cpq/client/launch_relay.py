"""The launch relay: a routed launch served by the pytest process's own client.

Under ``pytest --cpq-torchrun`` a test's ``torchrun ...`` is a process of its own. Run as
``python -m cpq torchrun`` it spent ~0.25 s before it said a word to the broker: an
interpreter with ``site``, then cpq's client imports (pyzmq, the protocol's message classes)
— most of a warm launch's cost (docs/design.md, "Warm torchrun launches"). The pytest
process that routes the launch has all of that loaded already, and a broker to talk to.

So the route folder's ``torchrun`` runs :data:`SHIM`, a stdlib-only program, as ``python
-sS`` (no ``site``: ~15 ms). It hands its command line, interpreter, working directory and
environment over a Unix socket to this relay, which runs the launch exactly as ``cpq
torchrun`` would (:func:`cpq.client.torchrun.run_launch`, the shim's process as the
:class:`~cpq.client.torchrun.Caller`), and gets back what to write on its stdout and stderr
and its exit status. Whatever the relay does not serve — a launch that cannot run warm,
another interpreter or broker, no relay at all — the shim hands to ``python -m cpq torchrun``
(an ``exec``, before anything was sent), which decides and says why, as before: one code path
decides what runs warm.

Wire: one request, one reply, each a 4-byte big-endian length and a JSON object (the shim
imports nothing of cpq). Request ``{"v": 1, "argv", "python", "cwd", "env"}``; reply
``{"fallback": why}`` or ``{"writes": [[1 or 2, text], ...], "code": int}``. A shim that goes
away (killed by its test's time-out) cancels its task, as a killed ``cpq torchrun`` does. The
socket is in a private temporary folder, and only processes of this user are served
(``SO_PEERCRED``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from typing import Any

from cpq.client import torchrun

log = logging.getLogger("cpq.client")

#: The relay's socket, in the environment of everything the tests start (a task variable).
RELAY_VAR = "CPQ_LAUNCH_RELAY"
#: A request's size limit: a command line and an environment, not a payload.
MAX_REQUEST_BYTES = 16 << 20
#: What chooses a launch's broker (cpq.paths.default_endpoint and the endpoint variable).
_BROKER_VARS = ("CPQ_ENDPOINT", "CPQ_STATE_DIR", "XDG_RUNTIME_DIR")
#: Longest path a Unix socket may bind (``sun_path`` less its terminating NUL).
_MAX_SOCKET_PATH = 107

SHIM = '''"""cpq's launch shim (pytest --cpq-torchrun): see cpq/client/launch_relay.py."""
import os
import sys


def _slow(args):
    """Run ``python -m cpq torchrun`` in this process's place (nothing was sent yet)."""
    os.execv(sys.executable, [sys.executable, "-m", "cpq", "torchrun", *args])


def _read(sock, size):
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _main(args):
    path = os.environ.get("@RELAY_VAR@")
    if not path or os.environ.get("CPQ_TORCHRUN_REAL"):
        _slow(args)
    import json
    import socket
    import struct

    request = {"v": 1, "argv": args, "python": sys.executable}
    try:
        request.update(cwd=os.getcwd(), env=dict(os.environ))
        body = json.dumps(request).encode()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.sendall(struct.pack(">I", len(body)) + body)
    except OSError:
        _slow(args)
    head = _read(sock, 4)
    data = head and _read(sock, struct.unpack(">I", head)[0])
    if not data:
        sys.stderr.write("cpq torchrun: the pytest process serving this launch went away\\n")
        sys.exit(1)
    reply = json.loads(data)
    if "fallback" in reply:
        sock.close()
        _slow(args)
    for fd, text in reply["writes"]:
        stream = sys.stdout if fd == 1 else sys.stderr
        stream.write(text)
        stream.flush()
    sys.exit(reply["code"])


_main(sys.argv[1:])
'''.replace("@RELAY_VAR@", RELAY_VAR)


class BadLaunchRequest(ValueError):
    """A request this relay does not read: the shim then runs ``cpq torchrun`` itself."""


def read_frame(conn: socket.socket) -> bytes | None:
    """One length-prefixed frame; None at end of stream."""
    head = _recv_exactly(conn, 4)
    if head is None:
        return None
    (size,) = struct.unpack(">I", head)
    if size > MAX_REQUEST_BYTES:
        raise BadLaunchRequest(f"a request of {size} bytes (at most {MAX_REQUEST_BYTES})")
    return _recv_exactly(conn, size)


def _recv_exactly(conn: socket.socket, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def write_frame(conn: socket.socket, value: dict[str, Any]) -> None:
    body = json.dumps(value).encode()
    conn.sendall(struct.pack(">I", len(body)) + body)


def parse_request(data: bytes) -> dict[str, Any]:
    """The request, its fields checked (fail closed: what is not read is refused)."""
    try:
        request = json.loads(data)
    except ValueError as exc:
        raise BadLaunchRequest(f"not JSON: {exc}") from None
    if not isinstance(request, dict) or request.get("v") != 1:
        raise BadLaunchRequest("not a version 1 request")
    argv, env = request.get("argv"), request.get("env")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise BadLaunchRequest("argv is not a list of strings")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise BadLaunchRequest("env is not a map of strings")
    for name in ("cwd", "python"):
        if not isinstance(request.get(name), str) or not os.path.isabs(request[name]):
            raise BadLaunchRequest(f"{name} is not an absolute path")
    unknown = set(request) - {"v", "argv", "env", "cwd", "python"}
    if unknown:
        raise BadLaunchRequest(f"unknown fields {sorted(unknown)}")
    return request


class _Output:
    """A stream of the shim's (1: stdout, 2: stderr), kept in order with the other."""

    def __init__(self, fd: int, writes: list[list[Any]]) -> None:
        self.fd, self.writes = fd, writes

    def write(self, text: str, /) -> int:
        self.writes.append([self.fd, text])
        return len(text)

    def flush(self) -> None:
        pass


class LaunchRelay:
    """Serves the launches of the shims in this session's routed processes (module doc)."""

    def __init__(self, endpoint: str, folder: str, path: str) -> None:
        self.endpoint = endpoint
        self.folder, self.path = folder, path
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(64)
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="cpq-launch-relay", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, endpoint: str) -> LaunchRelay | None:
        """A relay on a socket in a new private folder; None when none can be made (the
        shims then run ``cpq torchrun`` themselves, as before)."""
        folder = tempfile.mkdtemp(prefix="cpq-relay-")
        path = os.path.join(folder, "relay.sock")
        if len(path.encode()) > _MAX_SOCKET_PATH:
            shutil.rmtree(folder, ignore_errors=True)
            log.info("no launch relay: its socket path %s is too long", path)
            return None
        try:
            return cls(endpoint, folder, path)
        except OSError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            log.info("no launch relay: %s", exc)
            return None

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        self._server.close()
        self._thread.join(timeout=5)
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
        shutil.rmtree(self.folder, ignore_errors=True)

    # ---- the accepting thread, a thread per launch

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError as exc:
                if self._closed:
                    return
                # out of descriptors, say: the shims waiting in the backlog get their turn
                log.warning("launch relay: accept failed (%s); retrying", exc)
                time.sleep(0.1)
                continue
            try:
                threading.Thread(
                    target=self._serve, args=(conn,), name="cpq-launch", daemon=True
                ).start()
            except RuntimeError:  # no thread to be had: the shim runs cpq torchrun itself
                with contextlib.suppress(OSError):
                    write_frame(conn, {"fallback": "the launch relay has no thread free"})
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        watches: list[_Watch] = []
        with conn:
            try:
                reply = self._answer(conn, watches)
            except Exception as exc:  # never a launch lost without a word
                log.exception("launch relay")
                reply = {"writes": [[2, f"cpq torchrun: the launch relay failed: {exc}\n"]]}
                reply["code"] = 1
            with contextlib.suppress(OSError):
                if reply is not None:
                    write_frame(conn, reply)
                conn.shutdown(socket.SHUT_RDWR)  # ends the watcher's read, whatever the shim does
            for watch in watches:  # before the close: its descriptor may not be reused under it
                watch.join()

    def _answer(self, conn: socket.socket, watches: list[_Watch]) -> dict[str, Any] | None:
        from cpq.client.api import BrokerUnavailable

        if not _same_user(conn):
            return {"fallback": "the launch relay serves its own user's processes only"}
        try:
            data = read_frame(conn)
            if data is None:
                return None  # the shim went away before asking
            request = parse_request(data)
        except BadLaunchRequest as exc:
            return {"fallback": f"the launch relay could not read the request: {exc}"}
        env: dict[str, str] = request["env"]
        planned = torchrun.plan(request["argv"], env)
        why = planned.why or self._not_mine(request)
        if why:
            return {"fallback": why}
        try:
            client = self._connected(env)
        except (BrokerUnavailable, OSError, RuntimeError) as exc:
            return {"fallback": f"no broker: {exc}"}
        writes: list[list[Any]] = []
        caller = torchrun.Caller(env, request["cwd"], _Output(1, writes), _Output(2, writes))
        watch = _Watch(conn, client)
        watches.append(watch)
        try:
            code = torchrun.run_launch(planned, client, caller, on_sent=watch.sent)
        except Exception as exc:
            if isinstance(exc, BrokerUnavailable):
                self._forget(client)  # the next launch connects afresh
            if not watch.task_id:  # nothing was sent: the shim's own cpq torchrun may
                return {"fallback": f"the launch relay could not send it: {exc}"}
            if not isinstance(exc, (BrokerUnavailable, OSError, RuntimeError)):
                raise
            writes.append([2, f"cpq torchrun: the broker went away during the launch: {exc}\n"])
            code = 1
        finally:
            watch.done()
        return {"writes": writes, "code": code}

    def _not_mine(self, request: dict[str, Any]) -> str:
        """Why the shim's own ``cpq torchrun`` must take this launch ("" when it is ours)."""
        from cpq import specs

        env = request["env"]
        # The variables that choose a broker (cpq.paths): the same as this process's, or the
        # shim's own cpq torchrun finds its broker (not said: it runs warm there).
        if any(env.get(name) != os.environ.get(name) for name in _BROKER_VARS):
            return "another broker"
        if specs._canonical(request["python"]) != specs.interpreter():
            return "another interpreter"
        return ""

    def _connected(self, env: dict[str, str]) -> Any:
        from cpq.client.api import Client
        from cpq.client.autostart import ensure_broker

        with self._client_lock:
            if self._client is None:
                if self.endpoint.startswith("ipc://") and env.get("CPQ_AUTOSTART") != "0":
                    ensure_broker(self.endpoint)
                self._client = Client(self.endpoint, name=f"cpq-torchrun relay {os.getpid()}")
            return self._client

    def _forget(self, client: Any) -> None:
        """A client whose broker went away serves no later launch: the next makes another."""
        with self._client_lock:
            if self._client is client:
                self._client = None
        with contextlib.suppress(Exception):
            client.close()


class _Watch:
    """Cancels the launch when its shim goes away before the verdict (killed by its test's
    time-out): the shim sends nothing after its request, so a read returns only at its end."""

    def __init__(self, conn: socket.socket, client: Any) -> None:
        self.conn, self.client = conn, client
        self.task_id = ""
        self.finished = threading.Event()
        self.thread: threading.Thread | None = None

    def sent(self, task_id: str) -> None:
        self.task_id = task_id
        self.thread = threading.Thread(target=self._wait, name="cpq-launch-watch", daemon=True)
        self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=5)

    def _wait(self) -> None:
        try:
            self.conn.recv(1)
        except OSError:
            return
        if not self.finished.is_set():
            log.info("the shim of launch %s went away: cancelling it", self.task_id)
            with contextlib.suppress(Exception):
                self.client.cancel(self.task_id)

    def done(self) -> None:
        self.finished.set()


def _same_user(conn: socket.socket) -> bool:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return False
    _pid, uid, _gid = struct.unpack("3i", creds)
    return bool(uid == os.getuid())
