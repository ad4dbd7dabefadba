"""The post-mortem relay (``pytest --pdb``): one failing rank's debugger, the user's terminal.

A task submitted with ``debug_rank`` runs with ``debug`` set on its ranks: a rank whose task
fails keeps the failure's frames and waits, after its report, for a :class:`DebugAttach`.
When the verdict is ``failed``, :meth:`DebugSessions.open` picks the rank (the one the user
named when it failed, else the lowest failing rank), names it in the verdict
(``debug_rank``), lets the other failing ranks go, and holds the group: no task runs on it
while the user debugs. The client then attaches (or gives the session up, when pytest does
not enter the debugger: an xfail, say); debugger output and the user's lines travel as
:class:`~cpq.protocol.DebugOutput` / :class:`~cpq.protocol.DebugLine` through this broker.

When the session ends (the user continued or quit, the client went away, the rank died) the
group is recycled: after arbitrary code typed at a debugger its state is unknown, and the
other ranks may still sit in a collective the failing rank never joined.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from cpq import protocol
from cpq.broker.model import Client, Group, Task, task_key
from cpq.protocol import RankResult

log = logging.getLogger("cpq.broker")

#: Why a group is stopped after a debug session (``cpq-status`` shows it).
RECYCLED = "a debugger ran on rank {rank}: its state is unknown"


@dataclass
class Session:
    client: bytes
    task_id: str
    group: Group
    rank: int
    attached: bool = False


class DebugSessions:
    """Open post-mortems, by :func:`~cpq.broker.model.task_key`."""

    def __init__(
        self,
        clients: dict[bytes, Client],
        send_client: Callable[[bytes, protocol.Message | bytes], None],
        send_rank: Callable[[bytes, bytes], bool],
        stop_group: Callable[[Group, str], None],
    ) -> None:
        self.clients = clients
        self.send_client = send_client
        self.send_rank = send_rank
        self.stop_group = stop_group
        self.sessions: dict[str, Session] = {}

    def open(self, task: Task, group: Group, outcome: str, results: list[RankResult]) -> bool:
        """After a verdict of ``task`` on ``group``: hold the group for a post-mortem when the
        task asked for one and a rank failed with its frames kept. True: the group is held
        (the caller neither releases nor stops it); ``task.debug_rank`` names the rank."""
        wanted = task.submit.debug_rank
        if wanted is None or outcome != "failed" or task.orphaned:
            return False
        if "pdb-relay" not in (group.rank_features or ()):
            return False
        waiting = sorted(r.rank for r in results if r.outcome == "failed")
        if not waiting:
            return False
        rank = wanted if wanted in waiting else waiting[0]
        for other in waiting:
            if other != rank:  # their frames are not wanted: let them go back to waiting
                self._to_rank(group, other, protocol.DebugAttach(task.submit.task_id, False))
        task.debug_rank = rank
        group.task = None  # the task is decided; the group stays busy for nobody else
        self.sessions[task.key] = Session(task.client, task.submit.task_id, group, rank)
        log.info("holding group %s for a post-mortem of rank %d", group.id, rank)
        return True

    # ---- from the client

    def attach(self, client: Client, message: protocol.DebugAttach) -> None:
        session = self.sessions.get(task_key(client.identity, message.task_id))
        if session is None:
            self._ended(client.identity, message.task_id, "no post-mortem waits for this task")
            return
        self._to_rank(session.group, session.rank, message)
        if message.start:
            session.attached = True
        else:
            self.close(session, "")

    def line(self, client: Client, message: protocol.DebugLine) -> None:
        session = self.sessions.get(task_key(client.identity, message.task_id))
        if session is None or not session.attached:
            self._ended(client.identity, message.task_id, "the post-mortem is over")
            return
        self._to_rank(session.group, session.rank, message)

    def drop_client(self, client: Client) -> None:
        for session in [s for s in self.sessions.values() if s.client == client.identity]:
            self.close(session, "")

    # ---- from the rank

    def output(self, group: Group, rank_no: int, message: protocol.DebugOutput) -> None:
        session = self.sessions.get(task_key_of(self.sessions, group, message.task_id))
        if session is None or session.rank != rank_no:
            return  # a session already closed (its client left): nobody reads this
        self.send_client(session.client, message)
        if message.ended:
            self.close(session, "")

    def tick(self) -> None:
        """A held group that failed (a rank died, went silent) ends its session."""
        for session in list(self.sessions.values()):
            if session.group.state != "busy":
                why = session.group.stop_reason or "the group stopped"
                self.close(session, f"\n*** cpq: the post-mortem ended: {why}\n")

    def close(self, session: Session, say: str) -> None:
        key = task_key(session.client, session.task_id)
        if self.sessions.pop(key, None) is None:
            return
        if say:
            self._ended(session.client, session.task_id, say)
        if session.group.state == "busy":
            self.stop_group(session.group, RECYCLED.format(rank=session.rank))

    def _ended(self, client: bytes, task_id: str, text: str) -> None:
        if client in self.clients:
            self.send_client(client, protocol.DebugOutput(task_id, text=text, ended=True))

    def _to_rank(self, group: Group, rank_no: int, message: protocol.Message) -> None:
        rank = group.ranks.get(rank_no)
        if rank is not None:
            self.send_rank(rank.identity, protocol.encode(message))


def task_key_of(sessions: dict[str, Session], group: Group, task_id: str) -> str:
    """The session key of ``task_id`` on ``group`` (a rank does not know the client)."""
    for key, session in sessions.items():
        if session.group is group and session.task_id == task_id:
            return key
    return ""
