"""The warm caller's fork becoming the calling pytest process.

Everything a process gets from the shell that started it is the caller's, not the warm
caller's: the three standard descriptors (received over the socket), the variables, the
working directory, the umask, the CPU affinity, ``sys.argv``/``sys.orig_argv``, the import
path, ``__main__`` (pytest's, so ``multiprocessing``'s spawn re-imports the right one) and
``sys.stdin``/``stdout``/``stderr`` built over the new descriptors with the caller's
encoding, error handler and buffering. Signal dispositions go back to an interpreter's
own, or ignored where the caller's were (a shell's background job ignores ``SIGINT``).
The fork leads a process group of its own, so the warm caller can kill what it started
when the caller is killed. Then pytest runs exactly as ``python -m pytest`` runs it
(``pytest.console_main``), and the fork exits the way an interpreter exits: non-daemon
threads joined, ``atexit`` functions run, the streams flushed.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib.util
import io
import logging
import os
import signal
import socket
import sys
import threading
import traceback
import types
from typing import Any, NoReturn

from cpq.caller import wire
from cpq.rank import reset

_DEFAULT_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGALRM")


def become(message: dict[str, Any], fds: list[int], conn: socket.socket) -> NoReturn:
    conn.close()
    os.setpgid(0, 0)
    for name in _DEFAULT_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it at start
    for name in message.get("ignored") or ():  # what the caller's shell had it ignore
        if name in _DEFAULT_SIGNALS or name == "SIGINT":
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.umask(message["umask"])
    os.chdir(message["cwd"])
    reset.set_environ(message["environ"])
    affinity = message.get("affinity")
    if affinity and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, affinity)
    sys.argv[:] = message["argv"]
    sys.orig_argv = list(message.get("orig_argv") or message["argv"])
    sys.path[:] = message["path"]
    _quiet_cpq_logging()
    _set_main(message.get("main") or {})
    _set_streams(message["streams"])
    wire.served = message
    _run()


def _run() -> NoReturn:
    import pytest

    try:
        code: Any = pytest.console_main()
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:  # as an interpreter ends on one: the traceback, then SIGINT
        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(130)
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    _finish()
    os._exit(status & 0xFF)


def _finish() -> None:
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()  # the interpreter joins non-daemon threads before atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


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
    """What the interpreter builds over descriptor ``fd`` (``create_stdio``), with the
    caller's settings; None where the caller had none."""
    if not isinstance(info, dict):
        return None
    write = fd != 0
    mode = "w" if write else "r"
    raw = io.FileIO(fd, mode + "b", closefd=False)
    raw.name = f"<{name}>"
    buffer: Any = raw
    if write and not info.get("unbuffered"):
        buffer = io.BufferedWriter(raw)
    elif not write:
        buffer = io.BufferedReader(raw)
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
