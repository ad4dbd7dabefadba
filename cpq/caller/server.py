"""The warm caller's process: import what the project's sessions import, then fork one
calling session per request (docs/design.md, "The warm caller").

Started by a calling session that found none (:mod:`cpq.client.handoff`), with that
session's interpreter, options, variables and working directory: ``python -m cpq.caller
PLAN``. It takes the ready state a rank takes (:func:`cpq.rank.boundary.mark_ready`: cpq,
pytest, the standard library), imports the plan's modules as a rank imports ahead of a
session (:func:`cpq.rank.ahead.warm`: project families kept out of ``sys.modules`` until the
session imports them, checked then; families that cannot leave, torch's, stay loaded), and
only then listens. Each request is checked before anything forks:

* every file its loaded modules came from is unchanged (:class:`~cpq.rank.freshness.CodeWatch`)
  — else it refuses and exits once its sessions are done: the session starts a new one;
* every variable its imports read has the same value in the caller's variables — else it
  refuses that caller (a session of another environment) and stays;
* it runs no Python thread and has not initialised CUDA (a fork copies only the thread
  that forks).

The fork becomes the calling process (:mod:`cpq.caller.child`); this process tells the
caller the fork's pid, then its wait status, and kills the fork's process group when the
caller's connection closes first (the caller was killed). A newer warm caller of the
project (a plan that grew) takes the socket's path over by a rename once it is ready; this
one then exits when its sessions are done, as it does after ``CPQ_WARM_CALLER_IDLE_S``
(900 s) without a session.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from cpq.caller import blame, descriptors, fit, prepared, wire
from cpq.caller.fit import Refused
from cpq.rank import ahead, boundary, freshness, importenv

log = logging.getLogger("cpq.caller")

_TICK_S = 0.5


class Server:
    """The warm caller's state: its plan, its imports' reads, its forks."""

    def __init__(self, plan_file: Path, plan: wire.Plan, started_ns: int) -> None:
        self.plan_file = plan_file
        self.plan = plan
        self.watch = freshness.CodeWatch()
        self.started_ns = started_ns
        self.reads: dict[str, str | None] = {}
        #: Variables its imports set (name -> value), and what each fork does again from
        #: its start (:meth:`_keep`).
        self.environ_set: dict[str, str] = {}
        self.at_fork = ahead.Kept()
        #: fork pid -> the connection to its caller (None: the caller is gone).
        self.children: dict[int, socket.socket | None] = {}
        self.closing = ""
        self.idle_s = float(os.environ.get(wire.IDLE_VAR) or wire.DEFAULT_IDLE_S)
        self.last_used = time.monotonic()
        self.listener: socket.socket | None = None
        self.inode = -1
        self._last_pass_s: float | None = None  # the project's last pass, from its start
        #: Sessions prepared ahead (:mod:`cpq.caller.prepared`).
        self.preparer = prepared.Preparer([])

    def warm(self) -> bool:
        """Import the plan ahead. False when a module's own code did what a fork cannot take
        or what cannot be replayed when the session imports it (initialised CUDA, started a
        thread, changed ``sys.path`` or ``os.environ`` other than by adding to them, the
        ``sys`` hooks, signal handlers or the root logger): that module, and every module
        that needs it, is then left out of this project's warm callers for good
        (``KEY.exclude.json``, :mod:`cpq.caller.blame`), and this process starts again
        without them. What can be put back is, after each of the plan's entries, and the
        pass goes on: one pass finds them all."""
        boundary.mark_ready()
        importenv.start_done()
        self.watch.scan(self.started_ns)
        started = time.perf_counter()
        last = wire.read_warming(self.plan.key).get("pass_s")  # the project's last pass
        self._last_pass_s = float(last) if isinstance(last, (int, float)) else None
        self._note_warming()
        left_out = wire.read_left_out(self.plan.key)
        planned = [name for name in self.plan.modules if name not in left_out]
        imported = 0
        blame_ = blame.Blame(left_out)
        start = blame.snapshot()
        start.update({"sys.path": self.plan.path, "os.environ": blame.encoded(self.plan.environ)})

        kept = ahead.Kept()  # what the imports did that a fresh process keeps, in order

        def after_import(name: str) -> bool:
            nonlocal imported
            blame_.look(fallback=name)
            if blame_.environ_set or blame_.path_appended:  # later imports see them, as
                start["os.environ"].update(blame_.environ_set)  # in a fresh process
                kept.add(ahead.Kept(_decoded(blame_.environ_set), blame_.path_appended))
                start["sys.path"] = self.plan.path + [
                    entry for entry in kept.path if entry not in self.plan.path
                ]
            blame.put_back(start)
            blame_.again()
            imported += 1
            if imported % 20 == 0:
                self._note_warming(imported / len(planned))
            return False

        ahead.plan(
            planned,
            self.plan.path,
            self.plan.cwd,
            self.plan.environ,
        )
        with blame_.watching():
            self.reads = ahead.warm(after_import=after_import, kept=kept)
        self._keep(blame_, kept)
        blame_.unwrap([*sys.modules.values(), *ahead.held_modules()])
        if ahead.last_refusal and not blame_.blamed:  # refused for what no import was seen doing
            blame_.blamed["*"] = ahead.last_refusal  # fail closed: the project gets no warm caller
        if blame_.blamed:  # what it imported is not what a fork may take: never served as it is
            self._leave_out(blame_)
            return False
        self.watch.scan(self.started_ns)
        names = prepared.to_import(self.plan.modules, left_out)
        self.preparer = prepared.Preparer(names, self.plan.key)
        pass_s = time.time() - self.started_ns / 1e9
        wire.note_warming(self.plan.key, time.time(), pass_s, serving=True)
        wire.passes_served(self.plan.key)
        log.info(
            "warm in %.2fs: %d modules loaded, %s waiting to be imported; variables "
            "its imports set (set again in each session): %s; left out: %s",
            time.perf_counter() - started,
            len(sys.modules),
            ", ".join(ahead.held())[:300] or "none",
            ", ".join(sorted(kept.environ))[:300] or "none",
            ", ".join(f"{name} ({why})" for name, why in left_out.blamed.items())[:600] or "none",
        )
        return True

    def _keep(self, blame_: blame.Blame, kept: ahead.Kept) -> None:
        """The variables the imports set and the entries they appended to ``sys.path`` (a
        fresh process keeps them) are set again where the module that set them is loaded:
        in each fork from its start (a module that stays loaded), or when the session
        imports the part that holds it. Such a variable binds none of the imports (a fresh
        process sets it too); the session's value before the imports must be the one they
        found (:meth:`_check`)."""
        self.environ_set = dict(kept.environ)
        self.reads = {k: v for k, v in self.reads.items() if k not in kept.environ}
        ahead.forget_reads(kept.environ)
        self.at_fork = ahead.Kept()
        for module, replay in blame_.replays.items():
            each = ahead.Kept(_decoded(replay.environ), list(replay.path))
            if not ahead.keep_at_hand_over(module.partition(".")[0], each):
                self.at_fork.add(each)

    def _leave_out(self, blame_: blame.Blame) -> None:
        """What the pass blamed and what needs it, to ``KEY.exclude.json`` and the log."""
        left_out = wire.add_left_out(
            self.plan.key, blame_.blamed, blame_.needing(), prepared.cuda_only(blame_)
        )
        pass_s = time.time() - self.started_ns / 1e9  # what the next pass will take
        wire.note_warming(self.plan.key, time.time() + pass_s, pass_s)
        log.info(
            "leaving out %s, and %d modules that need them; starting again",
            "; ".join(f"{name}: its code {why}" for name, why in blame_.blamed.items())[:1000],
            len(left_out.needing),
        )
        again = list(blame_.ran_again.items())  # dependencies the record did not see
        for name, where in again[:5]:
            log.info("%s ran again although left out, %s", name, where)
        if len(again) > 5:
            log.info("and %d more modules left out ran again", len(again) - 5)

    def _note_warming(self, done: float = 0.0) -> None:
        """Say when this process expects to serve, for a session that comes meanwhile
        (:func:`cpq.caller.wire.wait_until`): as long after its start as the project's last
        pass took (this process's, when it started again); without one, as long as the
        session that planned it took to start, or later where the pass's progress
        (``done``: the share of the plan imported) says so — a first pass competes for the
        CPUs with the session that started it."""
        started = self.started_ns / 1e9
        if self._last_pass_s is not None:
            ready_by = started + self._last_pass_s
        else:
            ready_by = started + self.plan.start_s
            if done >= 0.1:
                ready_by = max(ready_by, time.time() + (time.time() - started) * (1 / done - 1))
        wire.note_warming(self.plan.key, ready_by, self._last_pass_s)

    # ---- the socket

    def listen(self, path: Path) -> None:
        """Bind a socket of its own and move it over ``path`` (a rename: a session
        connecting meanwhile reaches the old warm caller or this one, never neither). The
        one it replaces sees its path taken and exits once its sessions are done."""
        mine = path.with_name(f"{path.stem}.{os.getpid()}")
        mine.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(mine))
        os.chmod(mine, 0o600)
        listener.listen(16)
        self.inode = os.stat(mine).st_ino  # before the rename: a newer one may follow it
        os.replace(mine, path)
        self.listener = listener

    def serve(self, path: Path) -> None:
        while self.listener is not None or self.children or self.preparer.parked:
            if self.preparer.wanted(serving=self.listener is not None):
                self.preparer.fork(self._forget_sockets, self.at_fork, self.plan)
            readable: list[Any] = [c for c in self.children.values() if c is not None]
            if self.listener is not None:
                readable.append(self.listener)
            readable += self.preparer.sockets()
            ready, _, _ = select.select(readable, [], [], _TICK_S)
            for sock in ready:
                if sock is self.listener:
                    self._accept()
                elif isinstance(sock, prepared.Candidate):
                    self.preparer.heard()
                else:
                    self._caller_gone(sock)
            self._reap()
            for conn, message, fds, _ in self.preparer.due():
                self._admit(conn, message, fds, may_wait=False)
            why = self.closing or self._why_close(path)
            if why and self.listener is not None:
                log.info("closing: %s", why)
                self.listener.close()
                self.listener = None
                self.preparer.drop("the warm caller closes", for_good=False)
                if self._owns(path):
                    path.unlink(missing_ok=True)
        self.preparer.drop("the warm caller closes", for_good=False)

    def _owns(self, path: Path) -> bool:
        try:
            return os.stat(path).st_ino == self.inode
        except OSError:
            return False

    def _why_close(self, path: Path) -> str:
        if not self._owns(path):
            if not os.path.lexists(path):
                return "its socket was removed (cpq stop)"
            return "a newer warm caller serves the project"
        if self.children:
            self.last_used = time.monotonic()
        elif time.monotonic() - self.last_used > self.idle_s:
            return f"no session for {self.idle_s:.0f}s"
        return ""

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except OSError as exc:  # out of descriptors, say: that caller runs its own session
            log.info("accept failed: %s", exc)
            return
        conn.settimeout(5.0)
        fds: list[int] = []
        try:
            message, fds = wire.recv(conn, maxfds=descriptors.TOP + 1)
        except Exception as exc:  # one request's trouble, never the others' sessions
            self._refuse(conn, fds, f"{type(exc).__name__}: {exc}", False)
            return
        if message is None:
            conn.close()
            return
        self._admit(conn, message, fds, may_wait=True)

    def _admit(
        self, conn: socket.socket, message: dict[str, Any], fds: list[int], may_wait: bool
    ) -> None:
        """Check the caller, then serve it, or let it wait for the session being prepared
        (``may_wait``). One that waited is checked again before it is served: a file may
        have changed meanwhile, and a fork would start with the old code."""
        try:
            self._check(message, fds)
        except Refused as refused:
            self._refuse(conn, fds, str(refused), refused.fatal)
            return
        except Exception as exc:  # one request's trouble, never the others' sessions
            self._refuse(conn, fds, f"{type(exc).__name__}: {exc}", False)
            return
        if may_wait and self.preparer.park(conn, message, fds):
            log.info(
                "a caller waits for the session being prepared (%.0f s at most)", prepared.PARK_S
            )
            return
        self._serve_one(conn, message, fds)

    def _serve_one(self, conn: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
        """Run the checked caller's session: the session prepared ahead takes it, or a
        fork."""
        pid = self.preparer.take(message, fds)
        if pid is not None:
            self._started(pid, conn, message, fds, " (prepared ahead)")
            return
        try:
            # What this process holds goes to the permanent generation before the fork (as
            # the gc docs advise for a fork server): the session's collections skip the
            # warm heap; the fork puts it back for its exit (child.become).
            gc.freeze()
            pid = os.fork()
        except Exception as exc:  # one request's trouble, never the others' sessions
            self._refuse(conn, fds, f"{type(exc).__name__}: {exc}", False)
            return
        if pid == 0:  # the fork: becomes the calling process and never comes back here
            try:
                from cpq.caller import child

                self._forget_sockets(keep=conn)
                child.become(message, fds, conn, self.at_fork)
            except SystemExit:
                raise  # the session's end: the interpreter exits as a fresh one does
            except BaseException:
                traceback.print_exc()  # on the caller's stderr once it is in place
            os._exit(70)
        self._started(pid, conn, message, fds, "")

    def _started(
        self, pid: int, conn: socket.socket, message: dict[str, Any], fds: list[int], how: str
    ) -> None:
        with contextlib.suppress(OSError):  # the fork may have done it already
            os.setpgid(pid, pid)
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):  # the caller is gone: _caller_gone kills the fork
            wire.send(conn, {"pid": pid})
        self.children[pid] = conn
        log.info("session %d started%s: %s", pid, how, " ".join(message["argv"])[:300])

    def _refuse(self, conn: socket.socket, fds: list[int], why: str, fatal: bool) -> None:
        for fd in fds:
            os.close(fd)
        log.info("refused a session: %s", why)
        with contextlib.suppress(OSError):
            wire.send(conn, {"refused": why})
        conn.close()
        if fatal:
            self.closing = why

    def _check(self, message: dict[str, Any], fds: list[int]) -> None:
        found = {name: self.plan.environ.get(name) for name in self.environ_set}
        fit.check_fork(message, fds, self.watch, self.reads, found, self.plan.environ)

    def _caller_gone(self, conn: socket.socket) -> None:
        """The caller's end closed (or sent something) while its session runs: it was
        killed, so the session is killed too, as a killed pytest process takes its
        session with it."""
        for pid, each in list(self.children.items()):
            if each is conn:
                log.info("session %d: its caller is gone; killing it", pid)
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
                conn.close()
                self.children[pid] = None

    def _reap(self) -> None:
        while self.children or self.preparer.candidate is not None:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.preparer.reaped(pid, status):
                continue
            if pid not in self.children:
                continue
            conn = self.children.pop(pid)
            log.info("session %d ended: wait status %d", pid, status)
            if conn is None:
                continue
            with contextlib.suppress(OSError):
                wire.send(conn, {"status": status})
            conn.close()

    def _forget_sockets(self, keep: socket.socket) -> None:
        if self.listener is not None:
            self.listener.close()
        for candidate in self.preparer.sockets():
            candidate.close()
        for waiting, _, fds, _ in self.preparer.parked:  # another caller's
            waiting.close()
            for fd in fds:
                os.close(fd)
        for conn in self.children.values():
            if conn is not None and conn is not keep:
                conn.close()


def _decoded(environ: dict[bytes, bytes]) -> dict[str, str]:
    return {os.fsdecode(k): os.fsdecode(v) for k, v in environ.items()}


def main(argv: list[str]) -> int:
    started_ns = time.time_ns()
    if len(argv) != 1:
        print("usage: python -m cpq.caller PLAN_FILE", file=sys.stderr)
        return 2
    handler = logging.StreamHandler(sys.stderr)  # the log file its starter opened
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s[%(process)d] %(message)s"))
    own = logging.getLogger("cpq")  # not the root logger: a fork's must be a fresh one's
    own.addHandler(handler)
    own.setLevel(logging.INFO)
    own.propagate = False
    plan_file = Path(argv[0])
    try:
        plan = wire.Plan.read(plan_file)
    except wire.WireError as exc:
        log.error("%s", exc)
        return 2
    import pytest  # noqa: F401  (the harness: every session's fork starts from it loaded)

    why = plan.notes.get("why")  # what made a session plan it
    why = f" (planned because {why})" if isinstance(why, str) and why else ""
    log.info("importing a plan of %d modules%s", len(plan.modules), why)
    if wire.gave_up(plan.key):
        log.info("not starting: this project's imports cannot be taken by a fork")
        return 3
    server = Server(plan_file, plan, started_ns)
    if not server.warm():  # start again, without the modules it left out
        if wire.gave_up(plan.key):
            log.info("giving up: %s", wire.read_left_out(plan.key).blamed)
            return 3
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    path = wire.socket_path(plan.key)
    try:
        server.listen(path)
    except OSError as exc:  # a state directory too deep for a socket's path (108 bytes)
        log.error("cannot listen on %s: %s", path, exc)
        return 1
    log.info("serving %s", path)
    server.serve(path)
    return 0
