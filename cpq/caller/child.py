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
killed. Then pytest runs exactly as ``python -m pytest`` runs it (``pytest.console_main()``),
and the fork ends as the interpreter ends a process up to its last observable step
(:func:`end_as_interpreter`), without the teardown of the warm heap after it.
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
import threading
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

    # As ``python -m pytest`` ends (an uncaught exception, KeyboardInterrupt among them,
    # unwinds to the interpreter as there: the warm caller's frames in between hold no
    # cleanup, cpq/caller/server.py).
    code: object
    try:
        code = pytest.console_main()
    except SystemExit as exc:  # a plugin's sys.exit(): the same end
        code = exc.code
    end_as_interpreter(code)


def end_as_interpreter(code: object) -> NoReturn:
    """End the fork with ``code`` as ``raise SystemExit(code)`` ends an interpreter, up to
    the last step anything can observe: non-daemon threads joined, ``atexit`` handlers run
    (coverage's data, ``logging.shutdown``, ``weakref.finalize`` and temporary
    directories), every file the session left open flushed, ``sys.stdout`` and
    ``sys.stderr`` flushed (a failure: status 120, as the interpreter's). Then
    ``os._exit``: the interpreter's teardown of what is still alive is left out.

    Why: that teardown collects the whole warm heap (torch, the project's modules), which
    the fork took over from the warm caller; on Megatron-LM's suite it was the largest
    single cost of a handed-over session's end (docs/design.md, "The warm caller"). What
    it would do beyond the steps above is what Python does not promise a program: the
    ``__del__`` of objects alive at the exit ("It is not guaranteed that __del__() methods
    are called for objects that still exist when the interpreter exits", the data model)
    and extension modules' own teardown (nanobind's leak report). A code that is not a
    number (a message, as ``sys.exit("why")``) takes the interpreter's own path."""
    shutdown = getattr(threading, "_shutdown", None)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if code is None:
        code = 0
    if not isinstance(code, int) or shutdown is None or run_exitfuncs is None:
        # The warm caller froze its heap before the fork (server._accept): the session's
        # collections skipped it. The interpreter's teardown collects it, as a fresh
        # process's (left frozen, triton's nanobind reports its objects as leaked).
        gc.unfreeze()
        raise SystemExit(code)
    status = int(code)
    shutdown()  # as Py_FinalizeEx begins: wait for the non-daemon threads
    run_exitfuncs()
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:  # the interpreter's exit status for a failed flush
            status = 120
    os._exit(status & 0xFF)  # what the OS keeps of SystemExit(status)


def _flush_open_files() -> None:
    """Flush what a fresh process's teardown would flush by closing it: every buffered
    file object the session opened and left open (a conftest's log file it never
    closed). Text wrappers first, so their buffers reach the binary ones below. The warm
    heap is frozen (``gc.get_objects`` leaves it out): its files are the warm caller's."""
    found = [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom))
    ]
    found.sort(key=lambda obj: not isinstance(obj, io.TextIOWrapper))
    for obj in found:
        if obj in (sys.stdout, sys.stderr):
            continue
        with contextlib.suppress(Exception):
            if not obj.closed:
                obj.flush()


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
