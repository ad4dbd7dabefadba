"""``cpq.Client``: submit tasks to a broker and wait for their verdicts.

The client mirrors the rank's threading: one DEALER socket, held by whichever thread waits
(:mod:`cpq.client.shared_socket`). A caller of :meth:`Client.submit` sends and reads its verdict
itself; a background thread heartbeats between tasks and resolves the futures of
:meth:`Client.submit_async`, so a test process can keep several tasks in flight, notices a
dead broker within ``liveness x heartbeat`` seconds even while it waits, and the broker
notices a dead client the same way (and drops its queued tasks).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import os
import queue
import socket
import sys
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypedDict

import zmq

if TYPE_CHECKING:
    from typing_extensions import Unpack  # PEP 692; typing has it from Python 3.11

from cpq import environ, paths, protocol, tracepoints
from cpq.client.capabilities import refuse_unread_options
from cpq.client.shared_socket import SharedSocket
from cpq.osutil import pid_namespace
from cpq.protocol import PoolSpec, TaskResult
from cpq.specs import BadRequest, make_spec

log = logging.getLogger("cpq.client")


class BrokerUnavailable(ConnectionError):
    """No broker answered, or the broker stopped answering."""


_LAST_ENVIRON: list[Any] = [None, ({}, {})]  # [os.environ's data then, its split]


def caller_environ() -> tuple[dict[str, str], dict[str, str]]:
    """This process's environment as ``(start, task)`` variables (:func:`environ.split`), now.

    Read on every submit (a variable a fixture set since the last task counts), so it is
    cached against ``os.environ``'s own bytes mapping: comparing two dicts of bytes is one
    C call, where decoding and classifying every variable again costs ~0.1-0.2 ms a task.
    """
    data = getattr(os.environ, "_data", None)  # os._Environ's store (CPython, POSIX)
    if isinstance(data, dict) and data == _LAST_ENVIRON[0]:
        split: tuple[dict[str, str], dict[str, str]] = _LAST_ENVIRON[1]
        return dict(split[0]), dict(split[1])
    split = environ.split(os.environ)
    _LAST_ENVIRON[:] = [dict(data) if isinstance(data, dict) else None, split]
    return dict(split[0]), dict(split[1])


def check_kwargs(kwargs: dict[str, Any]) -> None:
    """Name the argument that cannot travel, instead of failing somewhere on the wire."""
    for name, value in kwargs.items():
        if not isinstance(name, str):
            raise BadRequest(f"argument names must be strings, got {name!r}")
        problem = protocol.travel_problem(value)
        if problem:
            raise protocol.EncodeError(
                f"argument {name!r} (a {type(value).__name__}) cannot be sent to the ranks: "
                f"{problem}. Pass msgpack-able values (None, bool, int, float, str, "
                "bytes, lists and dicts of them with string keys) and build richer objects "
                "inside the task."
            )


def check_timeout(timeout: float) -> float:
    """A deadline must fire: NaN, inf, zero and negatives are refused before they travel."""
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise BadRequest(f"timeout must be a number of seconds, got {timeout!r}") from None
    if not 0 < seconds < math.inf:
        raise BadRequest(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    return seconds


class SubmitOptions(TypedDict, total=False):
    """How a task runs, beyond its target, world size and keyword arguments.

    ``timeout``: its deadline in seconds (default ``CPQ_TIMEOUT`` or 90). ``env``: variables
    it pins (part of the spec: its own groups). ``seed``: the fixed seed of ``random``,
    numpy and torch (1234). ``test_id``: the test it runs, for history and timelines.
    ``roots``/``backend``: the spec's import roots (default: the working directory and
    ``PYTHONPATH``) and torch.distributed backend (default: the broker's choice).
    ``affinity``: with several idle groups of the spec, the broker prefers the one that last
    ran a task with this key (a broker too old to know keys ignores it). ``retries``: infra
    failures it is run again for, each on a fresh group. ``debug_rank``: keep a failing
    rank's frames for :meth:`Client.debug_attach` (-1: the lowest failing rank). ``rng``:
    the ``random``/``numpy`` state the body starts with (:func:`cpq.rng.capture`; None: the
    fixed seed). ``coverage``: measure the body on every rank with this configuration
    (:func:`cpq.client.coverage_relay.session_config`); each rank's data comes back in
    ``TaskResult.coverage``. ``session``: the test session it belongs to (default: this
    client); ``own_groups``: run only on a group that served no other session;
    ``fresh_group``: run only on a group started for this task (it served no task before).
    ``environ``: the environment of the process the task is for, when that is not this one
    (the launch relay serves other processes' launches); default ``os.environ``, read now.
    """

    timeout: float | None
    env: dict[str, str] | None
    seed: int
    test_id: str
    roots: list[str] | None
    backend: str
    affinity: str
    retries: int
    debug_rank: int | None
    rng: dict[str, Any] | None
    coverage: dict[str, Any] | None
    session: str
    own_groups: bool
    fresh_group: bool
    environ: dict[str, str] | None


#: The options that are fields of the ``submit`` message as they are.
_SUBMIT_FIELDS = (
    "seed", "test_id", "affinity", "retries", "debug_rank", "rng", "coverage", "session",
    "own_groups", "fresh_group",
)  # fmt: skip


def submit_message(
    target: str, world_size: int, kwargs: dict[str, Any] | None, options: SubmitOptions
) -> tuple[protocol.Submit, dict[str, str]]:
    """The ``submit`` message of a task and the caller's task variables, read now (a
    variable a fixture set since the last task counts); refuses bad input before sending."""
    kwargs = dict(kwargs or {})
    check_kwargs(kwargs)
    timeout = options.get("timeout")
    timeout = paths.default_timeout() if timeout is None else check_timeout(timeout)
    given = options.get("environ")
    start, task_env = caller_environ() if given is None else environ.split(given)
    pinned = options.get("env") or {}
    # What the task pins is the task's too: its ranks see it, as a fresh launch with it in
    # its environment would, and a rank whose imports read it finds the value it started with.
    task_env = {**task_env, **{k: v for k, v in pinned.items() if isinstance(v, str)}}
    spec = make_spec(
        world_size,
        options.get("env"),
        options.get("roots"),
        options.get("backend", ""),
        caller_env=start,
    )
    fields: dict[str, Any] = {k: options[k] for k in _SUBMIT_FIELDS if k in options}  # type: ignore[literal-required]
    message = protocol.Submit(
        task_id=uuid.uuid4().hex,
        target=target,
        spec=spec,
        kwargs=kwargs,
        timeout=timeout,
        env=task_env,
        **fields,
    )
    return message, task_env


def client_info(name: str, info: dict[str, Any] | None) -> dict[str, Any]:
    """What a client tells the broker of itself in its hello (``info`` adds to it)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pidns": pid_namespace(),  # lets the broker look at this process
        "name": name or os.path.basename(sys.argv[0] or "python"),
        "xdist_worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "features": sorted(protocol.ALL_FEATURES),  # what this client can decode
        **(info or {}),
    }


def broker_pace(broker: dict[str, Any], heartbeat_s: float, liveness: int) -> tuple[float, int]:
    """The client's heartbeat and liveness with a broker that welcomed it so: at least as
    often as the broker expects, giving up on it as soon as it would give up on us (a
    broker run with a short --heartbeat drops a client that keeps the 1 s default, and its
    clients should notice its death as fast). A welcome without them changes nothing."""
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return min(heartbeat_s, float(broker["heartbeat_s"])), min(
            liveness, int(broker["liveness"])
        )
    return heartbeat_s, liveness


class Client:
    """A connection to a broker. Use as a context manager, or call :meth:`close`."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        name: str = "",
        heartbeat_s: float = 1.0,
        liveness: int = 5,
        connect_timeout_s: float = 10.0,
        info: dict[str, Any] | None = None,
    ) -> None:
        self.endpoint = endpoint or paths.default_endpoint()
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.broker: dict[str, Any] = {}
        self._info = client_info(name, info)
        self._waiting: dict[str, list[str]] = {}  # task id -> "still waiting" notices
        #: The task variables of the last submit, when the broker remembers them (feature
        #: ``env-delta``): an equal set then travels as ``env_same``.
        self._env_sent: dict[str, str] | None = None
        self._context: zmq.Context[Any] = zmq.Context()
        self._tasks: dict[str, Future[TaskResult]] = {}
        self._control: deque[Future[Any]] = deque()
        self._debug: dict[str, queue.Queue[protocol.DebugOutput]] = {}  # task id -> output
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._failure: BrokerUnavailable | None = None
        #: Frames from the broker that were junk (see :meth:`_on_frame`).
        self.malformed = 0
        #: The kinds a broker sends a client, each to its handler (docs/design.md "Wire").
        self._handlers: dict[type[protocol.Message], Callable[[Any], None]] = {
            protocol.Done: self._on_done,
            protocol.Waiting: self._on_waiting,
            protocol.Closing: self._on_closing,
            protocol.Welcome: self._on_reply,
            protocol.StatusReply: self._on_reply,
            protocol.ErrorReply: self._on_error,
            protocol.DebugOutput: self._on_debug_output,
            protocol.Heartbeat: lambda message: None,  # its arrival is the point
        }
        try:
            self._socket = SharedSocket(
                self._context,
                self.endpoint,
                self._on_frame,
                self._on_silence,
                heartbeat_s,
                liveness,
            )
        except Exception as exc:  # a malformed endpoint, a missing or unsafe key file
            self._context.term()
            raise BrokerUnavailable(
                f"cannot connect to a cpq broker at {self.endpoint}: {exc}"
            ) from exc
        except BaseException:
            self._context.term()
            raise
        self._thread = threading.Thread(target=self._serve, name="cpq-client-io", daemon=True)
        self._thread.start()
        try:
            welcome = self._control_request(protocol.Hello(client=self._info), connect_timeout_s)
        except BaseException:
            self.close()
            raise
        self.broker = welcome.broker
        self.broker_features = frozenset(self.broker.get("features") or ())
        self.heartbeat_s, self.liveness = broker_pace(self.broker, heartbeat_s, liveness)
        self._socket.heartbeat_s, self._socket.liveness = self.heartbeat_s, self.liveness
        self._socket.watching = True

    # ---- public API

    def submit(
        self,
        target: str,
        world_size: int,
        kwargs: dict[str, Any] | None = None,
        *,
        on_wait: Callable[[str], None] | None = None,
        on_sent: Callable[[str], None] | None = None,
        **options: Unpack[SubmitOptions],
    ) -> TaskResult:
        """Run ``target`` on every rank of a warm group and wait for the verdict.

        ``options`` are :class:`SubmitOptions`. ``on_wait`` is called (in this thread) with
        the broker's word on why the task is still waiting for a group, a few seconds into
        a wait; ``on_sent`` with the task's id once it is sent (for :meth:`cancel` from
        another thread). If this call is interrupted (Ctrl-C, pytest-timeout), the task is
        cancelled at once: its group does not stay busy for nobody.
        """
        future = self._submit(target, world_size, kwargs, options, lead=True)
        task_id: str = future.task_id  # type: ignore[attr-defined]
        if on_sent is not None:
            on_sent(task_id)
        try:
            self._wait(future, on_wait)
        except BaseException:
            if not future.done():
                with contextlib.suppress(BrokerUnavailable):
                    self._send(protocol.Cancel(task_id=task_id))
            raise
        tracepoints.mark(task_id, "client returns")
        return future.result()

    def wait(
        self, future: Future[TaskResult], on_wait: Callable[[str], None] | None = None
    ) -> TaskResult:
        """The verdict of a task sent with :meth:`submit_async`, read in this thread as
        :meth:`submit` reads its own (``on_wait`` as there)."""
        self._wait(future, on_wait)
        return future.result()

    def cancel(self, task_id: str) -> None:
        """Cancel a task this client sent (a finished one: nothing happens); its
        :meth:`submit` then returns the broker's verdict on the cancelled task."""
        self._send(protocol.Cancel(task_id=task_id))

    def _wait(self, future: Future[TaskResult], on_wait: Callable[[str], None] | None) -> None:
        """Read the socket in this thread until ``future`` is done (no thread hand-off);
        while another caller's thread holds the socket, it reads for this one too. The
        task's "still waiting" notices go, however it ends."""
        task_id: str = future.task_id  # type: ignore[attr-defined]
        sock = self._socket
        sock.spinner.note()  # its answer may come soon: the first moment spins (cpq.spin)
        try:
            while not future.done():
                if sock.take(timeout_s=0.05):
                    try:
                        while not future.done() and not (on_wait and self._waiting.get(task_id)):
                            sock.pump(int(min(250, self.heartbeat_s * 500)), spin=True)
                    finally:
                        sock.release()
                        if self._tasks or self._control:  # others' futures: the background reads
                            sock.kicked.set()
                # Not holding the socket: a slow callback must not stop heartbeats and reads.
                if on_wait is not None:
                    for notice in self._take_waiting(task_id):
                        on_wait(notice)
        finally:
            self._waiting.pop(task_id, None)

    def _take_waiting(self, task_id: str) -> list[str]:
        with self._lock:
            notices = self._waiting.get(task_id) or []
            if notices:
                self._waiting[task_id] = []
            return notices

    def submit_async(
        self,
        target: str,
        world_size: int,
        kwargs: dict[str, Any] | None = None,
        **options: Unpack[SubmitOptions],
    ) -> Future[TaskResult]:
        """Like :meth:`submit` but returns a future; many may be in flight at once."""
        return self._submit(target, world_size, kwargs, options, lead=False)

    def _submit(
        self,
        target: str,
        world_size: int,
        kwargs: dict[str, Any] | None,
        options: SubmitOptions,
        lead: bool,
    ) -> Future[TaskResult]:
        """Send the task; ``lead``: the caller reads its verdict itself (:meth:`_wait`)."""
        began = tracepoints.now()
        message, task_env = submit_message(target, world_size, kwargs, options)
        refuse_unread_options(message, self.broker_features, self.endpoint)
        future: Future[TaskResult] = Future()
        future.task_id = message.task_id  # type: ignore[attr-defined]
        with self._lock:  # "the previous submit" is the one sent before: decide in order
            self._raise_if_failed()
            if self._env_sent is not None and self._env_sent == task_env:
                message.env, message.env_same = None, True
            frame = protocol.encode_for(message, self.broker_features)
            if "env-delta" in self.broker_features:
                self._env_sent = task_env
            self._tasks[message.task_id] = future
            tracepoints.mark(message.task_id, "client submits", began)
            tracepoints.mark(message.task_id, "client sends")  # before: the reply may come first
            sent_now = self._socket.send(frame)
        if sent_now and not lead:  # nobody holds the socket to read the verdict
            self._socket.kicked.set()
        return future

    def debug_attach(self, task_id: str) -> queue.Queue[protocol.DebugOutput]:
        """Open the post-mortem a failed task's verdict named (``result.debug_rank``): the
        debugger's output arrives on the returned queue (``prompt``: answer with
        :meth:`debug_line`; ``ended``: over). See ``cpq.broker.debugging``."""
        output: queue.Queue[protocol.DebugOutput] = queue.Queue()
        with self._lock:
            self._raise_if_failed()
            self._debug[task_id] = output
            self._socket.send(protocol.encode(protocol.DebugAttach(task_id, start=True)))
        self._socket.kicked.set()  # the background thread reads the debugger's output
        return output

    def debug_line(self, task_id: str, line: str, eof: bool = False) -> None:
        self._send(protocol.DebugLine(task_id, line=line, eof=eof))

    def debug_release(self, task_id: str) -> None:
        """Give up a post-mortem nobody will open (the broker recycles the group)."""
        with self._lock:
            self._debug.pop(task_id, None)
        with contextlib.suppress(BrokerUnavailable):
            self._send(protocol.DebugAttach(task_id, start=False))

    def status(self, timeout_s: float = 10.0) -> dict[str, Any]:
        reply: protocol.StatusReply = self._control_request(protocol.StatusRequest(), timeout_s)
        return reply.status

    def warm(self, specs: list[PoolSpec], counts: list[int] | None = None) -> None:
        """Ask the broker to start groups for ``specs`` now (no reply expected)."""
        self._send(protocol.Warm(specs=specs, counts=counts or []))

    def stop(self, drain: bool = False, timeout_s: float = 10.0) -> dict[str, Any]:
        reply: protocol.StatusReply = self._control_request(
            protocol.StopRequest(drain=drain), timeout_s
        )
        return reply.status

    def close(self) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            say_goodbye = self._failure is None
        # Whatever still waits (another thread's submit, futures) hears it now, and a caller
        # pumping the socket for its verdict lets go of it.
        self._fail_all(BrokerUnavailable("this client is closed"))
        self._socket.kicked.set()
        self._thread.join(timeout=5)
        if self._socket.close(protocol.encode(protocol.Goodbye()), say=say_goodbye):
            self._context.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed.is_set():
            raise BrokerUnavailable("this client is closed")

    def _send(self, message: protocol.Message) -> None:
        frame = protocol.encode(message)
        with self._lock:
            self._raise_if_failed()
            self._socket.send(frame)

    def _control_request(self, message: protocol.Message, timeout_s: float) -> Any:
        future: Future[Any] = Future()
        frame = protocol.encode(message)
        with self._lock:
            self._raise_if_failed()
            self._control.append(future)
            self._socket.send(frame)
        self._socket.kicked.set()  # the background thread reads the answer
        try:
            return future.result(timeout=timeout_s)
        except (TimeoutError, concurrent.futures.TimeoutError):  # one class from 3.11 on
            raise BrokerUnavailable(
                f"no answer from a cpq broker at {self.endpoint} within {timeout_s:g}s "
                "(start one with `cpq-broker`, or let the pytest plugin start it)"
            ) from None

    def _serve(self) -> None:
        """The background thread. If it dies, every caller hears of it instead of waiting."""
        try:
            self._socket.serve(
                lambda: bool(self._tasks or self._control or self._debug), self._closed
            )
        except BaseException as exc:
            log.debug("the cpq client's I/O thread failed", exc_info=True)
            self._fail_all(BrokerUnavailable(f"the cpq client's I/O thread failed: {exc!r}"))

    def _on_silence(self, silent_s: float) -> None:
        if self._failure is None:
            self._fail_all(
                BrokerUnavailable(
                    f"the cpq broker stopped answering ({silent_s:.1f}s without a heartbeat: "
                    f"it died or was killed) at {self.endpoint}"
                )
            )

    def _on_frame(self, frame: bytes) -> bool:
        """Handle one frame from the broker by its kind's handler; False for junk, which is
        counted in ``malformed``, logged, and no sign of a live broker."""
        junk = protocol.dispatch(frame, self._handlers)
        if junk:
            self.malformed += 1
            log.error("dropping from the broker %s", junk)
        return not junk

    def _on_done(self, message: protocol.Done) -> None:
        tracepoints.mark(message.result.task_id, "client decoded the verdict")
        future = self._tasks.pop(message.result.task_id, None)
        if future is not None:
            future.set_result(message.result)

    def _on_debug_output(self, message: protocol.DebugOutput) -> None:
        with self._lock:
            output = self._debug.get(message.task_id)
            if message.ended:
                self._debug.pop(message.task_id, None)
        if output is not None:
            output.put(message)

    def _on_waiting(self, message: protocol.Waiting) -> None:
        with self._lock:
            if message.task_id in self._tasks:
                self._waiting.setdefault(message.task_id, []).append(message.message)

    def _on_closing(self, message: protocol.Closing) -> None:
        self._fail_all(
            BrokerUnavailable(f"the cpq broker stopped ({message.reason}) at {self.endpoint}")
        )

    def _on_reply(self, message: protocol.Welcome | protocol.StatusReply) -> None:
        if self._control:
            self._control.popleft().set_result(message)

    def _on_error(self, message: protocol.ErrorReply) -> None:
        with self._lock:
            self._env_sent = None  # a refused submit may not have set the broker's copy
        future = self._tasks.pop(message.task_id, None) if message.task_id else None
        target = future or (self._control.popleft() if self._control else None)
        if target is not None:
            target.set_exception(BadRequest(message.message))
        else:
            log.error("broker error: %s", message.message)

    def _fail_all(self, error: BrokerUnavailable) -> None:
        with self._lock:
            self._failure = error
            tasks, self._tasks = self._tasks, {}
            control, self._control = self._control, deque()
            debug, self._debug = self._debug, {}
        for task_id, output in debug.items():
            output.put(protocol.DebugOutput(task_id, text=f"*** {error}\n", ended=True))
        for future in [*tasks.values(), *control]:
            if not future.done():
                future.set_exception(error)
