"""The calling process's half of the warm caller (docs/design.md, "The warm caller").

At ``pytest_load_initial_conftests`` — before any conftest imports, the first of the
plugin's hooks that knows the options and the rootdir — a ``--cpq-world-size`` session asks
the project's warm caller (:mod:`cpq.caller`) to run it: the command line, variables,
working directory, umask, affinity, import path and descriptors (0-2 and whatever else the
shell passed, at their numbers) go over; a fork of the warm caller runs the session with
them, and this process only relays signals and exits with the fork's status. Refused or
absent, the session runs here as always.

At the session's end (``pytest_unconfigure``) the session writes the project's **plan** —
the modules it imported, in order, and how it started — and starts a warm caller from it
when none serves the project. ``CPQ_WARM_CALLER``: ``0`` never; ``1`` always; unset
(``auto``) when the session took at least 5 s to start (process start to the session's
start), which is what a warm caller saves.

A session is handed over only where the fork is the same process a fresh start would be:
pytest is ``__main__`` (``pytest ...`` or ``python -m pytest ...``, not a script calling
``pytest.main``), nothing traces it (coverage, a profiler: what the warm caller imported
would not be measured), no ``--pdb``/``--trace`` (a debugger's terminal), not an xdist
worker, a launcher's rank, a shard, nor a run that runs no test.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from cpq.caller import descriptors, wire

#: The import path and variables as the interpreter started (this module is imported by
#: the plugin while pytest loads its plugins, before anything of the session changed them).
_START_PATH = list(sys.path)
_START_ENV = {k: v for k, v in os.environ.items() if k != "PYTEST_VERSION"}  # main() sets it

#: What this session's start looked like, when it may be handed over or planned.
_start: dict[str, Any] = {}

_RELAYED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH", "SIGCONT")
_ALL_SIGNALS = tuple(
    s.name
    for s in signal.valid_signals()
    if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)
)


def mode() -> str:
    value = os.environ.get(wire.ENABLE_VAR, "").strip().lower()
    if value in ("0", "off", "no", "false"):
        return "off"
    return "on" if value in ("1", "on", "yes", "true") else "auto"


def _served() -> dict[str, Any] | None:
    """The request this process serves when it is a warm caller's fork (``wire.served``)."""
    return wire.served


def served() -> bool:
    """Whether this session runs in a warm caller's fork (its summary line says so)."""
    return wire.served is not None


def refused() -> str:
    """Why the project's warm caller did not take this session ("" when none refused it):
    its summary line says so — a newcomer found the reason only in the warm caller's log."""
    return "" if served() else str(_start.get("refused") or "")


def _start_path() -> list[str]:
    served = _served()
    return list(served["path"]) if served else list(_START_PATH)


def _start_env() -> dict[str, str]:
    served = _served()
    return dict(served["environ"]) if served else dict(_START_ENV)


def at_start(config: Any) -> None:
    """``pytest_load_initial_conftests``: hand the session over, or note how it started.
    Returns only when the session runs in this process."""
    _start.clear()
    try:
        why = why_not(config)
    except Exception as exc:  # an optimisation only: the session runs here
        why = f"{type(exc).__name__}: {exc}"
    if why:
        return
    key = wire.key_of(str(config.rootpath), _start_path())
    _start.update(key=key, interpreter=_interpreter())
    if _served() is not None:
        # What the warm caller's imports of modules that stay loaded in it (torch's, a
        # family that registered torch operators) warned: a fresh process warns it when
        # its conftests import them — now, inside pytest's capture of this phase.
        wire.say_staying()
        return
    sock = wire.connect(wire.socket_path(key), 2.0) or _wait_for_warming(key)
    if sock is None:
        return
    _start["answered"] = True
    # pytest captures descriptors 0-2 around this hook (its capture plugin wraps it): the
    # session's own are those it saved, put back while the session is handed over.
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    try:
        _start["refused"] = _hand_over(sock)  # returns only when refused
    except Exception as exc:  # a message that cannot be sent (text that is not UTF-8)
        sock.close()
        _start["refused"] = f"{type(exc).__name__}: {exc}"
    finally:
        if capture is not None:
            capture.resume_global_capture()


def _wait_for_warming(key: str) -> socket.socket | None:
    """No warm caller answers: wait for one that is warming, when it expects to serve before
    this session would have started by itself (:func:`cpq.caller.wire.wait_until`) — a
    second ``pytest`` right after a first one. Polls its socket, and gives up when it
    exits."""
    try:
        plan = _read_plan(key)
        start_s, since = (plan.start_s if plan else 0.0), time.time()
        warming = wire.read_warming(key)
        until = wire.wait_until(warming, start_s, since)
        while time.time() < until:
            time.sleep(0.1)  # polling the socket a warming process binds when it is ready
            sock = wire.connect(wire.socket_path(key), max(0.1, min(2.0, until - time.time())))
            if sock is not None:
                return sock
            warming = wire.read_warming(key) or warming  # its estimate, as its pass goes on
            if not wire.alive(int(warming["pid"])) or float(warming["ready_by"]) > since + start_s:
                return None  # gone, or now later than a start of this session's own
    except Exception:  # an optimisation only: the session runs here
        return None
    return None


def at_session_start(config: Any) -> None:
    """The session starts (its conftests imported): note how long that took — what a warm
    caller saves — and, when no warm caller serves the project, start one from what this
    process imported so far (the conftests' imports, the bulk), so that it is ready long
    before this session ends."""
    _check_prepared()
    if not _start or _served() is not None or "start_s" in _start:
        return
    try:
        import psutil

        _start["start_s"] = time.time() - psutil.Process().create_time()
        if "answered" not in _start and _worth_it():
            why = "no warm caller answered the session"
            modules = modules_to_plan(_test_file_patterns(config))
            _plan_and_spawn(config, _read_plan(_start["key"]), why, modules)
            _start["spawned"] = True
    except Exception:  # an optimisation only
        return


def _check_prepared() -> None:
    """A session prepared ahead (:mod:`cpq.caller.prepared`) imported modules before this
    session's conftests ran, with CUDA initialised under the variables the session started
    with: one whose conftests changed a ``CUDA_`` variable, or a variable those imports
    read, would import them otherwise in a fresh process (other devices, other settings) —
    fail it, and prepare none of the project's sessions again."""
    served = _served()
    prepared = served.get("prepared") if served is not None else None
    if prepared is None:
        return
    if isinstance(prepared, dict):
        started, reads = prepared.get("environ") or {}, prepared.get("reads") or {}
        changed = sorted(
            name
            for name in set(os.environ) | set(started)
            if name.startswith("CUDA_") and os.environ.get(name) != started.get(name)
        ) or sorted(name for name, value in reads.items() if os.environ.get(name) != value)
        if not changed:
            return
        why = f"the session changed {changed[0]} after a session prepared ahead imported with it"
    else:  # a record it cannot read: what to check is unknown (fail closed)
        kind = type(prepared).__name__
        why = f"the session prepared ahead sent a record cpq cannot read ({kind})"
    if "key" in _start:
        with contextlib.suppress(OSError):
            wire.no_prepared(_start["key"], why)
    import pytest

    raise pytest.UsageError(
        f"cpq: {why}; the session would not run as a fresh process would. "
        "Run it again: this project's sessions are no longer prepared ahead."
    )


def at_end(config: Any) -> None:
    """``pytest_unconfigure``: when this session imported what the project's warm caller
    does not import ahead, or none served it, start one that does (it takes over from the
    old one once ready) — unless the one this session started is still importing: a second
    would compete with it for the CPUs, and the next session plans what this one added."""
    if not _start or not _worth_it():
        return
    try:
        if "spawned" in _start and wire.still_warming(_start["key"]):
            return  # the one this session started imports still: a second would slow it
        old = _read_plan(_start["key"])
        modules = modules_to_plan(_test_file_patterns(config))
        if _served() is not None and old is not None:
            # A fork starts with what its warm caller loaded (more than the plan: what the
            # plan's imports import in turn): what the session imported itself is the news.
            known = set(old.modules) | wire.forked_with
            new = [name for name in modules if name not in known]
            modules = [*old.modules, *new]
        else:
            new = [name for name in modules if old is None or name not in set(old.modules)]
        unserved = _served() is None and (
            bool(_start.get("refused")) or not ("answered" in _start or "spawned" in _start)
        )
        # What the warm caller held aside was stale for this session (a file edited since):
        # every later session would import it again; a new one imports what is there now.
        stale = _served() is not None and wire.stale_ahead()
        why = (
            ("no warm caller served the session" if unserved else "")
            or (
                f"what the warm caller held aside was stale for the session: {stale}"
                if stale
                else ""
            )
            or ("there was no plan" if old is None else "")
            or (
                f"the session imported {len(new)} modules the plan lacks: {', '.join(new[:8])}"
                if new
                else ""
            )
        )
        if why:
            _plan_and_spawn(config, old, why, modules)
    except Exception:  # an optimisation only: the next session starts as it would anyway
        return


def _worth_it() -> bool:
    """``auto``: a session that took at least 5 s to start; a served one (its warm caller
    was worth it)."""
    if mode() == "on" or _served() is not None:
        return mode() != "off"
    return mode() == "auto" and float(_start.get("start_s", 0.0)) >= wire.AUTO_MIN_START_S


def _plan_and_spawn(config: Any, old: wire.Plan | None, why: str, modules: list[str]) -> None:
    if wire.gave_up(_start["key"]):
        return  # its imports a fork cannot take: no warm caller for this project
    start_s = float(_start.get("start_s", 0.0))
    plan = wire.Plan(
        key=_start["key"],
        modules=modules,
        path=_start_path(),
        cwd=str(config.invocation_params.dir),
        environ=_start_env(),
        interpreter=_start["interpreter"],
        start_s=old.start_s if _served() is not None and old is not None else start_s,
        notes={"why": why[:500]},
    )
    _spawn(plan.write(), plan)


def why_not(config: Any) -> str:
    """Why this session may not be handed over or planned ("" when it may)."""
    if mode() == "off":
        return f"{wire.ENABLE_VAR}=0"
    if not sys.platform.startswith("linux") or not hasattr(socket, "send_fds"):
        return "not Linux"
    options = config.known_args_namespace
    from cpq.client import early_warm

    if not (
        getattr(options, "cpq_world_size", None)
        or os.environ.get("CPQ_WORLD_SIZE")
        or config.getini("cpq_world_size")
    ):
        return "no --cpq-world-size"
    if early_warm.runs_no_test(options) or early_warm._is_shard(config):
        return "runs no test here"
    if "PYTEST_XDIST_WORKER" in os.environ or (
        "RANK" in os.environ and ("TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ)
    ):
        return "an xdist worker or a launcher's rank"
    if getattr(options, "usepdb", False) or getattr(options, "trace", False):
        return "a debugger may read the terminal"
    if sys.gettrace() is not None or sys.getprofile() is not None or _monitored():
        return "traced"
    if sys.flags.interactive or sys.flags.verbose or "importtime" in sys._xoptions:
        return "interpreter options that watch this process (-i, -v, -X importtime)"
    beyond = [fd for fd in _inherited_descriptors() if fd > descriptors.TOP]
    if beyond:
        return f"descriptors {beyond} passed to it, above {descriptors.TOP}"
    if getattr(options, "cov_source", None) or any(k.startswith("COV_CORE_") for k in os.environ):
        return "under coverage"
    if _main_info() is None:
        return "pytest is not __main__"
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            return f"no descriptor {fd}"
    return ""


def _monitored() -> bool:
    """A ``sys.monitoring`` tool in use (Python 3.12+: cProfile, coverage's sysmon core)."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return False
    return any(monitoring.get_tool(tool) is not None for tool in range(6))


def _inherited_descriptors() -> list[int]:
    """Descriptors above 2 a child would inherit: what the shell passed this process
    (``3>file``, ``/dev/fd/63``, ``make``'s jobserver), which the fork gets at the same
    numbers (:mod:`cpq.caller.descriptors`). Python opens its own descriptors
    non-inheritable: pytest's capture files and this plugin's socket are not among them."""
    try:
        numbers = sorted(int(n) for n in os.listdir("/proc/self/fd"))
    except OSError:
        return []
    found = []
    for fd in numbers:
        if fd > 2:
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    found.append(fd)
    return found


# ---------------------------------------------------------------------------- handing over


def _hand_over(sock: socket.socket) -> str:
    """Send the session; wait for it and exit as it did. Returns why it was refused."""
    umask = os.umask(0)
    os.umask(umask)
    message = {
        "argv": list(sys.argv),
        "orig_argv": list(getattr(sys, "orig_argv", sys.argv)),
        "path": list(_START_PATH),
        "cwd": os.getcwd(),
        "environ": dict(_START_ENV),
        "umask": umask,
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "streams": [_stream_info(s) for s in (sys.stdin, sys.stdout, sys.stderr)],
        "main": _main_info(),
        "interpreter": wire.interpreter_identity(),
        "pid": os.getpid(),
        "ignored": [name for name in _ALL_SIGNALS if _ignored(name)],
        "mask": sorted(int(n) for n in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    }
    fds = message["fds"] = [0, 1, 2, *_inherited_descriptors()]
    try:
        wire.send(sock, message, fds)
        sock.settimeout(30.0)
        reply, _ = wire.recv(sock)
    except (OSError, wire.WireError) as exc:
        sock.close()
        return f"no answer: {exc}"
    if reply is None or not isinstance(reply.get("pid"), int):
        sock.close()
        return str((reply or {}).get("refused", "the warm caller closed"))
    _wait_and_exit(sock, reply["pid"])


def _wait_and_exit(sock: socket.socket, pid: int) -> NoReturn:
    """Relay signals to the session's process until it ends; exit as it did."""

    def relay(signum: int, frame: Any) -> None:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)

    for name in _RELAYED:
        if not _ignored(name):  # ignored here, it is ignored there too (child.become)
            signal.signal(getattr(signal, name), relay)
    sock.settimeout(None)
    try:
        reply, _ = wire.recv(sock)
    except (OSError, wire.WireError):
        reply = None
    status = reply.get("status") if reply else None
    if not isinstance(status, int):
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        os.write(2, b"cpq: the warm caller ended before the session did\n")
        os._exit(1)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # ended by a signal: end by it too, as the shell would have seen it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)
    os._exit(code)


def _ignored(name: str) -> bool:
    return signal.getsignal(getattr(signal, name)) is signal.SIG_IGN


def _stream_info(stream: Any) -> dict[str, Any] | None:
    if stream is None:
        return None
    return {
        "encoding": getattr(stream, "encoding", None),
        "errors": getattr(stream, "errors", None),
        "line_buffering": bool(getattr(stream, "line_buffering", False)),
        "write_through": bool(getattr(stream, "write_through", False)),
        "unbuffered": not hasattr(getattr(stream, "buffer", None), "raw"),
    }


def _main_info() -> dict[str, Any] | None:
    """``__main__``'s file and spec name when it is pytest's (None otherwise)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    spec_name = getattr(spec, "name", None)
    path = getattr(main, "__file__", None)
    if spec_name in ("pytest.__main__", "pytest"):
        return {"file": path, "spec": spec_name}
    console_script = isinstance(path, str) and os.path.basename(path) in ("pytest", "py.test")
    if console_script and os.path.abspath(str(path)) == os.path.abspath(sys.argv[0]):
        return {"file": path, "spec": None}
    return None


def _interpreter() -> list[str]:
    """The interpreter and its options, from how this process was started."""
    orig = list(getattr(sys, "orig_argv", []))
    options: list[str] = []
    i = 1
    while i < len(orig):
        arg = orig[i]
        if arg in ("-m", "-c", "-") or not arg.startswith("-"):
            break
        options.append(arg)
        if arg in ("-W", "-X", "--check-hash-based-pycs") and i + 1 < len(orig):
            options.append(orig[i + 1])
            i += 1
        i += 1
    return [sys.executable, *options]


# ---------------------------------------------------------------------------- the plan


def modules_to_plan(test_patterns: list[str]) -> list[str]:
    """What this process imported that a warm caller may import ahead, in order: modules
    outside the standard library and the harness (cpq, pytest, pluggy) that have a spec to
    import them by (``torch._C._jit`` has none: its package makes it); no family holding a
    module pytest rewrote, a conftest or a test module (pytest imports those itself)."""
    skip = set(wire.NOT_PLANNED) | set(getattr(sys, "stdlib_module_names", ()))
    families: dict[str, list[str]] = {}
    bad: set[str] = set()
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if top in skip or top in bad or module is None:
            continue
        spec = getattr(module, "__spec__", None)
        if spec is None:
            continue
        path = getattr(module, "__file__", None)
        base = os.path.basename(path) if isinstance(path, str) else ""
        rewritten = type(getattr(spec, "loader", None)).__name__ == "AssertionRewritingHook"
        if (
            rewritten
            or base == "conftest.py"
            or any(fnmatch.fnmatch(base, p) for p in test_patterns)
        ):
            bad.add(top)
            families.pop(top, None)
            continue
        families.setdefault(top, []).append(name)
    return [name for names in families.values() for name in names]


def _test_file_patterns(config: Any) -> list[str]:
    try:
        return [str(p) for p in config.getini("python_files")]
    except Exception:
        return ["test_*.py", "*_test.py"]


def _read_plan(key: str) -> wire.Plan | None:
    try:
        return wire.Plan.read(wire.plan_path(key))
    except wire.WireError:
        return None


def _spawn(plan_file: Path, plan: wire.Plan) -> None:
    """Start the warm caller of ``plan`` in the background (it replaces one that serves an
    older plan: that one closes when it sees the plan change)."""
    log_file = wire.folder() / f"{plan.key}.log"
    last_pass_s = wire.read_warming(plan.key).get("pass_s")
    with open(log_file, "ab") as log:
        process = subprocess.Popen(
            [*plan.interpreter, "-m", "cpq.caller", str(plan_file)],
            cwd=plan.cwd,
            env=plan.environ,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    # Warming from now on, before its interpreter has started: a session that ends, or one
    # that comes, meanwhile must see it (its own note replaces this one).
    last = float(last_pass_s) if isinstance(last_pass_s, (int, float)) else None
    expected = plan.start_s if last is None else last
    wire.note_warming(plan.key, time.time() + expected, last, pid=process.pid)
