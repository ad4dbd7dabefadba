"""The warm caller's fork becoming the calling pytest process.

Everything a process gets from the shell that started it is the caller's, not the warm
caller's: its descriptors (received over the socket, each put at its number:
:mod:`cpq.caller.descriptors`), the variables, the
working directory, the umask, the CPU affinity, ``sys.argv``/``sys.orig_argv``, the import
path, ``__main__`` (pytest's, so ``multiprocessing``'s spawn re-imports the right one) and
``sys.stdin``/``stdout``/``stderr`` built over the new descriptors with the caller's
encoding, error handler and buffering. Signal dispositions go back to an interpreter's
own, or ignored where the caller's were (a shell's background job ignores ``SIGINT``),
with the caller's signal mask; numpy's global generator is seeded anew. The fork leads a
process group of its own, so the warm caller can kill what it started when the caller is
killed. Then pytest runs exactly as ``python -m pytest`` runs it
(``raise SystemExit(pytest.console_main())``), and the exit unwinds to the interpreter,
which ends the fork as it ends any process.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import importlib.util
import io
import logging
import os
import signal
import socket
import sys
import types
from typing import Any, NoReturn

from cpq.caller import descriptors, wire
from cpq.rank import ahead, reset


def become(
    message: dict[str, Any], fds: list[int], conn: socket.socket, kept: ahead.Kept
) -> NoReturn:
    """Become the caller (``message``, its descriptors ``fds``); ``kept``: the variables
    the imports of modules that stay loaded set, set again here as their import did there."""
    conn.close()
    # The warm caller froze its heap before the fork (server._accept): the session's
    # collections skip it. At the exit it is collected again, as a fresh process's is
    # (an object of it left uncollected would change what the exit does: triton's
    # nanobind reports leaks then).
    atexit.register(gc.unfreeze)
    os.setpgid(0, 0)
    _set_signals(message)
    descriptors.install(fds, message.get("fds", [0, 1, 2]))
    os.umask(message["umask"])
    os.chdir(message["cwd"])
    reset.set_environ({**message["environ"], **kept.environ})
    affinity = message.get("affinity")
    if affinity and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, affinity)
    sys.argv[:] = message["argv"]
    sys.orig_argv = list(message.get("orig_argv") or message["argv"])
    sys.path[:] = message["path"]
    sys.path += [entry for entry in kept.path if entry not in sys.path]
    _quiet_cpq_logging()
    _set_main(message.get("main") or {})
    _set_streams(message["streams"])
    _reseed()
    wire.served = message
    wire.forked_with = frozenset(sys.modules)
    wire.stale_ahead = ahead.stale
    wire.say_staying = ahead.say_staying
    import pytest

    # As ``python -m pytest`` ends: the exit unwinds to the interpreter, which joins
    # non-daemon threads, runs atexit, flushes and closes what is open, and turns the
    # code (or an uncaught KeyboardInterrupt) into the status (the warm caller's frames
    # in between hold no cleanup: cpq/caller/server.py).
    raise SystemExit(pytest.console_main())


def _set_signals(message: dict[str, Any]) -> None:
    """An interpreter's dispositions (``SIGINT`` raising, ``SIGPIPE`` and ``SIGXFSZ``
    ignored, the rest default), ignored where the caller's were, the caller's mask."""
    for number in signal.valid_signals():
        if number in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    for name in message.get("ignored") or ():
        if isinstance(name, str) and hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    mask = message.get("mask")
    if isinstance(mask, list):
        signal.pthread_sigmask(signal.SIG_SETMASK, [int(n) for n in mask])


def _reseed() -> None:
    """A fork copies its parent's generators; ``random`` reseeds itself after a fork, and
    numpy's global one, seeded from the OS when numpy was imported, is seeded again here."""
    numpy_random = getattr(sys.modules.get("numpy"), "random", None)
    if numpy_random is not None:
        with contextlib.suppress(Exception):
            numpy_random.seed()


def _quiet_cpq_logging() -> None:
    """The warm caller's own log goes to its log file; a fresh process configures none."""
    for name in ("cpq", "cpq.caller", "cpq.rank"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True


def _set_main(main: dict[str, Any]) -> None:
    module = types.ModuleType("__main__")
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    if isinstance(main.get("file"), str):
        module.__file__ = main["file"]
    spec_name = main.get("spec")
    spec = importlib.util.find_spec(spec_name) if isinstance(spec_name, str) else None
    module.__spec__ = spec
    module.__package__ = spec.parent if spec is not None else None
    sys.modules["__main__"] = module


def _set_streams(streams: list[Any]) -> None:
    names = ("stdin", "stdout", "stderr")
    for fd, (name, info) in enumerate(zip(names, streams, strict=True)):
        stream = _text_stream(fd, name, info)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _text_stream(fd: int, name: str, info: Any) -> Any:
    """What the interpreter builds over descriptor ``fd`` (``create_stdio``: ``io.open``
    with the default buffer size, ``st_blksize``, or none under ``-u``), with the caller's
    settings; None where the caller had none."""
    if not isinstance(info, dict):
        return None
    write = fd != 0
    mode = "w" if write else "r"
    buffering = 0 if write and info.get("unbuffered") else -1
    buffer: Any = io.open(fd, mode + "b", buffering=buffering, closefd=False)  # noqa: UP020, SIM115
    raw = getattr(buffer, "raw", buffer)
    raw.name = f"<{name}>"
    stream = io.TextIOWrapper(
        buffer,
        encoding=info.get("encoding"),
        errors=info.get("errors"),
        newline="\n",
        line_buffering=bool(info.get("line_buffering")),
        write_through=bool(info.get("write_through")),
    )
    stream.mode = mode  # type: ignore[misc]
    return stream
