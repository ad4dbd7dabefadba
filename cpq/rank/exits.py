"""``atexit`` in a rank: what a session's code registers runs when its session ends.

A fresh ``torchrun -m pytest`` rank is a process of its own: an ``atexit`` handler its
conftest or test modules register (remove a scratch directory, write a summary file, print
a last line) runs when that process exits, after pytest's session. A warm rank outlives the
session, and it ends with ``os._exit`` (``cpq.rank.io.hard_exit``), so such a handler would
never run. Here the rank's ``atexit.register`` records what is registered after the rank is
ready, with the module whose code registered it; at the session boundary
(:func:`cpq.rank.boundary.cross`, after a session or a launch), the handlers of the modules
that boundary forgets run, last registered first, as the interpreter runs them at its exit.

A handler registered by a module that stays loaded (the standard library, pytest, a
submodule of torch imported late) stays registered as before: running it would end that
module's state for every later session (``multiprocessing`` marks itself as exiting). One
registered by a module imported ahead of a session (:mod:`cpq.rank.ahead`) that the session
never took over is dropped with the module: a fresh process never imported it. Output goes
where the rank's output goes between tasks (its log), not to the session's report, since a
fresh rank's exit prints after its session's report too. A handler cannot take the rank
down: an exception is printed and the others run, as at an interpreter's exit; its
``os._exit`` ends only the handler; streams it closed or replaced are the rank's again after
it; what it registers while the handlers run is not run (nor is it at an interpreter's
exit). Only the rank installs this (the warm caller's fork exits through the interpreter,
which runs its own handlers).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import Any

_real_register = atexit.register
_real_unregister = atexit.unregister
_real_exit = os._exit


@dataclass
class Exit:
    """One registration: the registering module's name, the handler and its arguments."""

    module: str
    func: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


#: Registered since the rank was ready, in order.
pending: list[Exit] = []
#: Modules taken out of ``sys.modules`` since the last boundary by others than the boundary
#: (a session's test modules and conftests: ``cpq.rank.items``; a launch's ``__main__``:
#: ``cpq.rank.script``): theirs run there too.
gone: set[str] = set()
#: While handlers run: what they register is not run (the interpreter's exit runs none).
_running = False


class HardExit(BaseException):
    """``os._exit(code)`` called by a launched script or an atexit handler: it ends that
    code, not the warm rank (:func:`exit_raises`)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def exit_raises() -> Iterator[None]:
    """While inside: ``os._exit(code)`` flushes the streams and raises :class:`HardExit`."""
    real = os._exit

    def hard_exit(code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        raise HardExit(int(code))

    os._exit = hard_exit  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = real


def install() -> None:
    """Record what is registered from now on (the rank calls it once it is ready)."""
    atexit.register = _register
    atexit.unregister = _unregister


def _register(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Callable[..., Any]:
    if not callable(func):
        raise TypeError("the first argument must be callable")
    if _running:
        return func
    caller = sys._getframe(1)
    module = caller.f_globals.get("__name__", "") if caller is not None else ""
    pending.append(Exit(module if isinstance(module, str) else "", func, args, dict(kwargs)))
    return func


def _unregister(func: Callable[..., Any]) -> None:
    pending[:] = [entry for entry in pending if entry.func != func]  # atexit compares with ==
    _real_unregister(func)


def run_forgotten(forgotten: Container[str], loaded: Container[str]) -> int:
    """At a boundary: run the handlers of the ``forgotten`` modules and of those :data:`gone`
    (last registered first; one without a module counts as the session's); hand those of
    modules still ``loaded`` to the interpreter's ``atexit``, as before; drop the rest.
    Returns how many ran."""
    global _running
    entries, pending[:] = pending[:], []
    went = set(gone)
    gone.clear()
    due = []
    for entry in reversed(entries):
        if not entry.module or entry.module in forgotten or entry.module in went:
            due.append(entry)
        elif entry.module in loaded:
            _real_register(entry.func, *entry.args, **entry.kwargs)
    if not due:
        return 0
    streams = sys.stdout, sys.stderr
    _running = True
    try:
        with exit_raises():
            for entry in due:
                _call(entry)
    finally:
        _running = False
        sys.stdout, sys.stderr = streams  # a handler may have replaced or closed them
        if getattr(sys.stdout, "closed", False):
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the rank's from now on
        if getattr(sys.stderr, "closed", False):
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - the rank's from now on
    return len(due)


def _call(entry: Exit) -> None:
    """As the interpreter calls a handler: an exception is printed and the others run (an
    ``os._exit`` ends only the handler: the rank is not the process the handler meant)."""
    func = os._exit if entry.func is _real_exit else entry.func  # atexit.register(os._exit)
    try:
        func(*entry.args, **entry.kwargs)
    except HardExit as exc:
        text = f"an atexit callback {entry.func!r} called os._exit({exc.code}): the rank goes on\n"
    except BaseException:  # a KeyboardInterrupt too: atexit prints it and goes on
        text = f"Exception ignored in atexit callback {entry.func!r}:\n{traceback.format_exc()}"
    else:
        return
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # a handler closed it
        with contextlib.suppress(OSError):
            os.write(2, text.encode(errors="replace"))
