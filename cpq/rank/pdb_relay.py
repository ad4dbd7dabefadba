"""The rank's half of the post-mortem relay (``pytest --pdb``; broker: ``cpq.broker.debugging``).

A task run with ``debug`` keeps its failure (:func:`keep`). After the rank's report, the main
thread (which holds the rank's socket between tasks) waits in :func:`serve` for the broker's
:class:`~cpq.protocol.DebugAttach`: ``start`` runs :class:`RelayPdb` on the failure's
traceback, in this process, with the frames and locals of the failing test; pdb's stdin and
stdout are the socket (lines in, text out), so the user's terminal drives it through the
broker. Anything else (a release, a shutdown) drops the frames and the rank serves on; the
broker recycles the group after a session anyway.

``breakpoint()`` in a task body cannot stop a rank for a live session: the other ranks would
sit in their next collective until the deadline, and a rank's stdin is not a terminal. It
raises :class:`BreakpointInRank` instead, which fails the test at that line; under
``pytest --pdb`` the post-mortem then opens in the frame that called ``breakpoint()``.
"""

from __future__ import annotations

import os
import pdb
import sys
from types import FrameType, TracebackType
from typing import Any

from cpq import protocol
from cpq.rank.io import CPQ_DIR, Link


class BreakpointInRank(RuntimeError):
    """``breakpoint()`` ran in a task body (a rank has no terminal)."""


def refuse_breakpoint(*args: Any, **kwargs: Any) -> None:
    """``sys.breakpointhook`` on a rank: fail here, saying what to use instead."""
    rank = os.environ.get("RANK", "?")
    raise BreakpointInRank(
        f"breakpoint() on rank {rank}: a cpq rank has no terminal to stop at. Run pytest "
        "with --pdb: the test then fails here and the post-mortem opens in this frame on "
        "this rank, relayed to your terminal (--cpq-pdb-rank N picks the rank)."
    )


def install() -> None:
    sys.breakpointhook = refuse_breakpoint


_kept: list[BaseException] = []


def keep(exc: BaseException) -> None:
    """Hold a failed task's exception (and so its frames) until :func:`serve` decides."""
    _kept[:] = [exc]


def serve(link: Link, task_id: str) -> None:
    """Wait for the broker's word on ``task_id``'s post-mortem, and run it if asked."""
    exc = _kept.pop() if _kept else None
    attach = link.next_debug(task_id)
    if exc is None or attach is None or not attach.start:
        return
    relay = Relay(link, task_id)
    debugger = RelayPdb(relay)
    try:
        debugger.reset()
        debugger.interaction(None, exc.__traceback__)
    except Exception as error:  # the debugger itself broke: say so, end the session
        relay.write(f"*** cpq: the debugger failed: {error!r}\n")
    finally:
        relay.end(quit=bool(debugger.quitting))


class Relay:
    """pdb's stdin and stdout, over the rank's socket (the main thread holds it)."""

    def __init__(self, link: Link, task_id: str) -> None:
        self.link = link
        self.task_id = task_id
        self._out: list[str] = []

    def write(self, text: str) -> int:
        self._out.append(text)
        return len(text)

    def flush(self) -> None:
        if self._out:
            self._send(prompt=False)

    def readline(self) -> str:
        self._send(prompt=True)
        line = self.link.next_debug_line(self.task_id)
        if line is None or line.eof:
            return ""  # pdb reads EOF and quits
        return line.line + "\n"

    def end(self, quit: bool) -> None:
        self._send(prompt=False, ended=True, quit=quit)

    def _send(self, prompt: bool, ended: bool = False, quit: bool = False) -> None:
        text, self._out = "".join(self._out), []
        message = protocol.DebugOutput(
            self.task_id, text=text, prompt=prompt, ended=ended, quit=quit
        )
        self.link.send(protocol.encode(message))


class RelayPdb(pdb.Pdb):
    """pdb on the relay, starting in the user's frame (not in cpq's or pytest's helpers
    that raised for it: ``breakpoint()``'s hook, ``pytest.fail``)."""

    def __init__(self, relay: Relay) -> None:
        super().__init__(stdin=relay, stdout=relay, nosigint=True)  # type: ignore[arg-type]
        self.prompt = f"(Pdb rank {os.environ.get('RANK', '?')}) "

    def setup(self, f: FrameType | None, tb: TracebackType | None) -> Any:
        result = super().setup(f, tb)
        index = self.curindex
        while index > 0 and _helper(self.stack[index][0]):
            index -= 1
        if index != self.curindex:
            self.curindex = index
            self.curframe = self.stack[index][0]
            self.curframe_locals = self.curframe.f_locals
        return result


def _helper(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(CPQ_DIR) or bool(
        frame.f_locals.get("__tracebackhide__")
    )
