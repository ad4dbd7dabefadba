"""A session prepared ahead: a fork of the warm caller that imports, before any caller
comes, what only CUDA kept out of the warm caller (docs/design.md, "A session prepared
ahead").

The warm caller must not initialise CUDA: its forks could not use it. A module that reads
the GPU at import (Megatron-LM's ``megatron.core.ssm.ops.gdp.common`` asks for the device's
name and capability) is left out of it, with every module that needs it — on the GPU host
378 of Megatron-LM's modules, imported by every handed-over session's conftest again:
3.7 s of a 22.5 s session. A fork that will not fork again may initialise CUDA, so the warm
caller keeps one such fork ready: it imports those modules (and only those: a module that
also needs one left out for another reason stays the session's import), then waits. The
next caller is offered to it first; it checks what a fresh import would see differently
(a file changed since, a variable its imports read, a variable they set), takes the caller
or refuses (then the warm caller forks as before), and becomes the calling process as any
fork does (:func:`cpq.caller.child.become`). The warm caller then prepares the next one.

What differs from a fresh process, and is checked or accepted: CUDA is initialised from
the session's start rather than when its conftests import those modules — under the same
start variables (``CUDA_*`` are the warm caller's, checked equal to the caller's); a
session whose conftests then change a ``CUDA_`` variable, or one those imports read, fails
with a usage error instead of running on other devices or settings, and the project's
sessions are not prepared ahead again (``cpq.client.handoff``). What those imports
warned is warned again where the conftests' imports warn (as for modules that stay
loaded); what they printed is not said again.
``CPQ_PREPARE_AHEAD=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import logging
import os
import signal
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from cpq.caller import blame, descriptors, fit, wire
from cpq.rank import ahead, freshness, importenv, reset, warnfilters

log = logging.getLogger("cpq.caller")

ENV = "CPQ_PREPARE_AHEAD"
#: The words :func:`cpq.caller.blame.changes` uses for it.
CUDA = "initialised CUDA"
#: How long the warm caller waits for a prepared session's answer to an offer.
ANSWER_S = 5.0
#: How long a caller waits for the session being prepared, at most.
PARK_S = 10.0


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def cuda_only(blame_: blame.Blame) -> list[str]:
    """The modules a pass blamed for initialising CUDA alone, and those that need only
    such modules (a module that also needs one blamed for the root logger is not here)."""
    only_cuda = {name for name, why in blame_.blamed.items() if why == CUDA}
    needing = [name for name, by in blame_.culprits().items() if by <= only_cuda]
    return sorted(only_cuda) + sorted(needing)


def to_import(plan_modules: list[str], left_out: wire.LeftOut) -> list[str]:
    """What a session prepared ahead imports: the plan's modules left out only for CUDA,
    in the plan's order, of families loaded in the warm caller or held aside there
    (:mod:`cpq.rank.ahead`: the prepared imports take such a family over as the session
    would). Empty when the project's sessions are not to be prepared."""
    if left_out.no_prepared or not enabled():
        return []
    chosen, held = set(left_out.cuda_only), ahead.waiting()
    return [
        n
        for n in plan_modules
        if n in chosen and (n.partition(".")[0] in sys.modules or n.partition(".")[0] in held)
    ]


# ----------------------------------------------------------------------------- its side


@dataclass
class Prepared:
    """What the imports of a session prepared ahead did, checked for each caller."""

    names: list[str]
    reads: dict[str, str | None] = field(default_factory=dict)
    kept: ahead.Kept = field(default_factory=ahead.Kept)
    #: The values the variables the imports set had before (the caller's must be those).
    found: dict[str, str | None] = field(default_factory=dict)
    watch: freshness.CodeWatch | None = None


def prepare(
    names: list[str], where: wire.Plan | None = None, at_fork: ahead.Kept | None = None
) -> Prepared | str:
    """Import ``names`` here, in ``where``'s variables, directory and import path (the
    plan's, as the warm caller imported it: what the imports read is checked against each
    caller's variables); what they did, or why this fork cannot serve ("" never)."""
    started_ns = time.time_ns()
    if where is not None:
        reset.set_environ(where.environ)
        os.chdir(where.cwd)
        sys.path[:] = where.path
    if at_fork is not None:  # what the warm caller's imports set: each fork has it from its start
        at_fork.do()
    before, waiting = dict(os.environ), ahead.waiting()
    blame_ = blame.Blame()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.ExitStack() as stack:
            reads = stack.enter_context(importenv.diverted())
            caught = stack.enter_context(warnings.catch_warnings(record=True))
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
            stack.enter_context(blame_.watching())
            warnings.simplefilter("always")  # every warning, said again under the session's
            filters = list(warnings.filters)
            for name in names:
                importlib.import_module(name)
                blame_.look(fallback=name)
            added = warnfilters.delta(filters, list(warnings.filters))
    except BaseException as exc:  # SystemExit too: this fork, never the warm caller
        return f"importing failed: {type(exc).__name__}: {str(exc)[:200]}"
    if added is None:
        return "the imports changed the warning filters other than by adding to them"
    warnfilters.replay(*added)  # the record's capture undid them; a fresh process keeps them
    blame_.unwrap(list(sys.modules.values()))
    other = {name: why for name, why in blame_.blamed.items() if why != CUDA}
    if other:
        return "; ".join(f"{name} {why}" for name, why in other.items())[:300]
    done = Prepared(list(names))
    done.kept = ahead.Kept(
        {os.fsdecode(k): os.fsdecode(v) for k, v in blame_.environ_set.items()},
        list(blame_.path_appended),
    )
    # Families held aside that the imports took over (cpq.rank.ahead): their filters were
    # added inside the record above, and are added again; what their imports set, the
    # session sets from its start; what they read binds this fork.
    still = ahead.waiting()
    taken = {
        id(p): p
        for top, p in waiting.items()
        if top not in still and sys.modules.get(top) is p.detached.modules.get(top)
    }.values()  # handed over; not dropped as stale (then the imports loaded them afresh)
    for part in taken:
        ahead.refilter(part)
        done.kept.add(part.kept)
    done.found = {name: before.get(name) for name in done.kept.environ}
    # A variable an import set (here, or the warm caller's: each fork sets it from its
    # start) binds none of them: a fresh process sets it too (cpq.caller.server._keep).
    set_here = set(done.kept.environ) | set(at_fork.environ if at_fork is not None else ())
    done.reads = {k: v for k, v in reads.items() if k not in set_here}
    for part in taken:
        done.reads.update({k: v for k, v in part.reads.items() if k not in set_here})
    done.watch = freshness.CodeWatch()
    done.watch.scan(started_ns)
    ahead.say_at_start(list(caught or []))
    return done


@dataclass
class Refusal:
    """Why a prepared session cannot be a caller's; ``stale``: a file its code came from
    changed, so it cannot be any caller's (it exits, and the next one imports the edit)."""

    why: str = ""
    stale: bool = False


def refusal(done: Prepared, message: dict[str, Any]) -> Refusal:
    """Why this prepared session cannot be ``message``'s caller (``why`` "" when it can)."""
    if done.watch is not None:
        changed = done.watch.changed()
        if changed:
            return Refusal(f"{changed} changed since it was imported", stale=True)
    return Refusal(fit.misfit(message["environ"], done.reads, done.found))


def run(
    sock: socket.socket, names: list[str], at_fork: ahead.Kept, where: wire.Plan | None = None
) -> NoReturn:
    """The prepared session's life: import, say so, then serve one caller or exit when
    the warm caller closes its end."""
    from cpq.caller import child

    started = time.perf_counter()
    done = prepare(names, where, at_fork)
    said: dict[str, Any] = {"unfit": done} if isinstance(done, str) else {"ready": len(names)}
    said["took_s"] = round(time.perf_counter() - started, 3)
    try:
        wire.send(sock, said)
    except OSError:  # the warm caller closed meanwhile
        os._exit(0)
    if isinstance(done, str):
        os._exit(0)
    while True:
        message, fds = wire.recv(sock, maxfds=descriptors.TOP + 1)
        if message is None:
            os._exit(0)  # the warm caller closed: nobody will come
        refused = refusal(done, message)
        if refused.why:
            for fd in fds:
                os.close(fd)
            wire.send(sock, {"refused": refused.why, "stale": refused.stale})
            if refused.stale:
                os._exit(0)  # stale for every caller: the warm caller prepares none again
            continue
        wire.send(sock, {"taken": True})
        kept = ahead.Kept()
        kept.add(at_fork)
        kept.add(done.kept)
        # What the session checks once its conftests ran (cpq.client.handoff): the
        # variables it starts with, and what the prepared imports read.
        message["prepared"] = {
            "modules": len(names),
            "environ": {**message["environ"], **kept.environ},
            "reads": done.reads,
        }
        gc.freeze()  # as before a fork: the session's collections skip what is here
        child.become(message, fds, sock, kept)


# ------------------------------------------------------------ the warm caller's side


class Candidate:
    """The warm caller's handle on one prepared session (its process, its socket)."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock
        self.ready = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def heard(self) -> str:
        """Read what it said (it became ready, or cannot serve): "" while it may serve,
        else why it cannot."""
        try:
            message, _ = wire.recv(self.sock)
        except (OSError, wire.WireError) as exc:
            return f"its socket failed: {exc}"
        if message is None:
            return "it exited"
        if "ready" in message and not self.ready:
            self.ready = True
            log.info(
                "a session prepared ahead is ready: %s modules imported in %ss",
                message["ready"],
                message.get("took_s"),
            )
            return ""
        return str(message.get("unfit") or f"it said {sorted(message)}")

    def offer(self, message: dict[str, Any], fds: list[int]) -> Refusal:
        """Offer it the caller: no ``why`` when it took it, else why not (it stays ready
        when it refused a caller it does not fit; the warm caller forks for that caller).
        One that does not answer is killed first: it may have taken the caller, which must
        not get two sessions."""
        try:
            wire.send(self.sock, message, fds)
            self.sock.settimeout(ANSWER_S)
            answer, _ = wire.recv(self.sock)
        except (OSError, wire.WireError) as exc:
            self.ready = False
            self.kill()
            return Refusal(f"it did not answer: {exc}")
        finally:
            with contextlib.suppress(OSError):
                self.sock.settimeout(None)
        if answer is None:
            self.ready = False
            return Refusal("it exited")
        if answer.get("taken") is True:
            return Refusal()
        why = str(answer.get("refused") or f"it said {sorted(answer)}")
        return Refusal(why, stale=answer.get("stale") is True)

    def close(self) -> None:
        """Its end closes: a prepared session nobody took exits."""
        with contextlib.suppress(OSError):
            self.sock.close()

    def kill(self) -> None:
        """End it now (one not taken: hung, slow, or silent)."""
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)


#: A caller checked and waiting for the session being prepared: its connection, request
#: and descriptors, and until when it waits.
Parked = tuple[socket.socket, dict[str, Any], list[int], float]


class Preparer:
    """The warm caller's side: which modules a prepared session imports, the one ready or
    being prepared, the callers waiting for it, and why none is prepared any more.

    A caller that comes while one is being prepared waits for it (:data:`PARK_S` at
    most): what it would wait for is what its own session would import meanwhile."""

    def __init__(
        self, names: list[str], key: str = "", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.names = names
        self.clock = clock
        self.key = key  # the project's: a session may have stopped preparing (no_prepared)
        self.candidate: Candidate | None = None
        self.why_not = ""
        self.parked: list[Parked] = []

    def wanted(self, serving: bool) -> bool:
        """Whether to prepare one now (the warm caller forks it: it knows its sockets)."""
        return serving and bool(self.names) and not self.why_not and self.candidate is None

    def fork(
        self,
        forget: Callable[[socket.socket], None],
        at_fork: ahead.Kept,
        where: wire.Plan | None = None,
    ) -> None:
        """Fork the prepared session; ``forget(keep)`` closes in it the warm caller's
        sockets but ``keep``, and ``at_fork`` is what each fork does again from its start."""
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            gc.freeze()  # as before each fork of the warm caller's
            pid = os.fork()
        except OSError as exc:  # out of processes or memory: the warm caller serves on
            self.why_not = f"it could not be forked: {exc}"
            log.info("no session prepared ahead: %s", self.why_not)
            return
        if pid == 0:  # prepares, then becomes a calling process or exits: never returns
            try:
                ours.close()
                forget(theirs)
                run(theirs, self.names, at_fork, where)
            except SystemExit:
                raise  # the session's end, as in any fork (cpq.caller.server)
            except BaseException:
                traceback.print_exc()
            os._exit(70)
        theirs.close()
        self.started(pid, ours)

    def started(self, pid: int, sock: socket.socket) -> None:
        self.candidate = Candidate(pid, sock)

    def sockets(self) -> list[Candidate]:
        return [] if self.candidate is None else [self.candidate]

    def heard(self) -> None:
        if self.candidate is not None:
            self.drop(self.candidate.heard())

    def reaped(self, pid: int, status: int) -> bool:
        """Whether ``pid`` was the prepared session (it died before serving)."""
        if self.candidate is None or pid != self.candidate.pid:
            return False
        self.drop(f"it exited (wait status {status})")
        return True

    def drop(self, why: str, for_good: bool = True, taken: bool = False) -> None:
        """The prepared session cannot serve (``why``; "" when it still may): close its
        end and, unless it was ``taken`` (it is a caller's session now), end it; and,
        ``for_good``, prepare none again in this process."""
        if not why or self.candidate is None:
            return
        if for_good:
            log.info("no session prepared ahead any more: %s", why)
            self.why_not = why
        self.candidate.close()
        if not taken:
            self.candidate.kill()
        self.candidate = None

    def park(self, conn: socket.socket, message: dict[str, Any], fds: list[int]) -> bool:
        """Let the caller wait for the session being prepared (False: none is)."""
        if self.candidate is None or self.candidate.ready or self.parked:
            return False  # one caller waits for it; the next ones would wait for nothing
        self.parked.append((conn, message, fds, self.clock() + PARK_S))
        return True

    def due(self) -> list[Parked]:
        """The waiting callers to serve now: all once the prepared session is ready or
        gone, else those that waited long enough."""
        now, ready = self.clock(), self.candidate is None or self.candidate.ready
        due = [each for each in self.parked if ready or each[3] <= now]
        self.parked = [each for each in self.parked if each not in due]
        if due and not ready:  # it took longer than a session's own imports would
            self.drop(f"not ready after {PARK_S:.0f} s")
        return due

    def take(self, message: dict[str, Any], fds: list[int]) -> int | None:
        """Offer the caller to the ready prepared session: its pid when it took it (the
        next one is prepared anew), None when the warm caller forks for it."""
        candidate = self.candidate
        if candidate is None or not candidate.ready:
            return None
        stopped = wire.read_left_out(self.key).no_prepared if self.key else ""
        if stopped:  # a session found its CUDA variables changed (cpq.client.handoff)
            self.drop(stopped)
            return None
        refused = candidate.offer(message, fds)
        if refused.why:
            log.info("the session prepared ahead did not take a caller: %s", refused.why)
            if refused.stale:  # it exits; the next one imports the edited files
                self.drop(refused.why, for_good=False)
            elif not candidate.ready:
                self.drop(refused.why)
            return None
        self.drop("taken", for_good=False, taken=True)  # it became the calling process
        return candidate.pid
