"""The broker's socket-facing side: frames in, each message to its handler.

Kept apart from the state-owning :class:`~cpq.broker.loop.Broker` (as circus keeps its
controller apart from the arbiter): this module knows frames, identities and which message
classes each socket may carry; the broker knows clients, groups and tasks and fills in the
two handler tables, keyed by message class and built once (the way pytest-xdist's DSession
dispatches ``worker_<event>``).

Fail closed: a frame that does not decode, or a message of a class the socket's table does
not hold (a client's ``hello`` on the ranks' socket, a rank's report on the clients'), is
dropped, counted in ``totals.malformed`` and logged; a client also gets an ``error`` reply.
Junk proves nothing about its sender: it creates no client record and refreshes no peer's
liveness. But a frame from a registered rank that does not decode also goes to
:attr:`Controller.on_rank_unreadable`: it may have been that rank's report on its task, and
a task must not wait for its deadline on a report nobody can read. See docs/design.md
"Module map", "Liveness" and "Task outcome".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cpq import protocol, tracepoints
from cpq.broker.clock import Clock
from cpq.broker.model import Client, Group, Rank, Totals

log = logging.getLogger("cpq.broker")

ClientHandler = Callable[[Client, Any], None]
RankHandler = Callable[[Group, Rank, Any], None]


class Controller:
    """Decodes what both sockets receive and calls the handler of the message's class."""

    def __init__(
        self,
        clock: Clock,
        totals: Totals,
        clients: dict[bytes, Client],
        ranks: dict[bytes, tuple[Group, Rank]],
        send_client: Callable[[bytes, protocol.Message | bytes], None],
        rank_hello: Callable[[bytes, protocol.RankHello], object],
        after_message: Callable[[protocol.Message | None], None],
    ) -> None:
        self.clock = clock
        self.totals = totals
        self.clients = clients
        self.ranks = ranks
        self.send_client = send_client
        self.rank_hello = rank_hello
        self.after_message = after_message
        self.client_handlers: dict[type[protocol.Message], ClientHandler] = {}
        self.rank_handlers: dict[type[protocol.Message], RankHandler] = {}
        #: Called with (group, rank, why) when a registered rank's frame does not decode.
        self.on_rank_unreadable: Callable[[Group, Rank, str], None] | None = None

    def on_client_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._junk("a message of %d frames (expected 1 payload frame)", len(frames) - 1)
            if frames:
                self.send_client(
                    frames[0], protocol.ErrorReply("expected exactly one payload frame")
                )
            return
        identity, frame = frames
        client = self.clients.get(identity)
        arrived = tracepoints.now()
        try:
            message = protocol.decode(frame)
        except protocol.ProtocolError as exc:
            self._junk("malformed message from client %s: %s", identity.hex(), exc)
            if client is not None:
                # It may have been a submit whose variables a later env_same means: forget
                # them, so that one is refused rather than run with older ones.
                client.last_env = None
            reply = protocol.ErrorReply(f"malformed message: {exc}", _task_id_of(frame))
            self.send_client(identity, reply)
            return
        if isinstance(message, protocol.Submit):
            tracepoints.mark(message.task_id, "broker reads the submit", arrived)
        handler = self.client_handlers.get(type(message))
        if handler is None:
            self._junk("%r from client %s: not a client message", message.KIND, identity.hex())
            self.send_client(
                identity, protocol.ErrorReply(f"{message.KIND!r} is not a client message")
            )
            return
        now = self.clock.monotonic()
        if client is None:
            client = self.clients[identity] = Client(
                identity, last_seen=now, connected_at=self.clock.time()
            )
        client.last_seen = now
        handler(client, message)
        self.after_message(message)

    def on_rank_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._junk("a message of %d frames (expected 1 payload frame)", len(frames) - 1)
            if frames:
                self._unreadable(frames[0], f"{len(frames) - 1} frames, not 1")
            return
        identity, frame = frames
        arrived = tracepoints.now()
        try:
            message = protocol.decode(frame)
        except protocol.ProtocolError as exc:
            self._junk("malformed message from rank peer %s: %s", identity.hex(), exc)
            self._unreadable(identity, f"a frame that does not decode: {exc}")
            return
        if isinstance(message, protocol.RankDone):
            tracepoints.mark(message.task_id, "broker reads a report", arrived)
        if isinstance(message, protocol.RankHello):
            self.rank_hello(identity, message)  # checks the group's token itself
            return
        known = self.ranks.get(identity)
        if known is None:
            self._junk("%r from an unknown rank peer %s", message.KIND, identity.hex())
            return
        group, rank = known
        handler = self.rank_handlers.get(type(message))
        if handler is None:
            self._junk(
                "%r from rank %d of group %s: not a rank message", message.KIND, rank.rank, group.id
            )
            return
        rank.last_seen = self.clock.monotonic()
        handler(group, rank, message)
        self.after_message(message)

    def _unreadable(self, identity: bytes, reason: str) -> None:
        """A registered rank sent what does not decode: its task cannot wait for a report
        that will never be read, so :attr:`on_rank_unreadable` hears of it (fail closed,
        and fast). From an unknown peer it stays junk, and nothing more."""
        known = self.ranks.get(identity)
        if known is not None and self.on_rank_unreadable is not None:
            self.on_rank_unreadable(*known, reason)
            self.after_message(None)

    def _junk(self, what: str, *args: object) -> None:
        self.totals.malformed += 1
        log.warning("dropping " + what, *args)


def _task_id_of(frame: bytes) -> str:
    """The task id a refused frame carried, if it was a map naming one: the client's refusal
    then reaches the submit that waits for it, not another request of the client's."""
    try:
        data = protocol.unpack(frame)
    except Exception:
        return ""
    task_id = data.get("task_id") if isinstance(data, dict) else None
    return task_id if isinstance(task_id, str) and len(task_id) <= 256 else ""
