"""Warm torchrun launches: a script run as ``__main__`` on every rank, as torchrun would.

``cpq torchrun [options] SCRIPT [ARGS]`` (``cpq.client.torchrun``) sends ``TARGET`` with the
script (or ``-m`` module), its arguments and the caller's working directory; every rank of
a warm group then does what a fresh torchrun worker would:

* ``sys.argv`` is the script and its arguments; ``sys.path`` is a new worker's: the script's
  folder (the working directory for ``-m``), then ``PYTHONPATH``'s entries, then the
  interpreter's own (:func:`worker_path`; not the group's import roots, nor the folder the
  rank started in); the working directory and environment are the caller's
  (the rank's reset applied them), and the worker variables torchrun's agent sets are there
  (the rank is a torchrun worker: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*``, the
  ``TORCHELASTIC_*`` ones, with this run's id and an error file for ``@record``);
* ``dist.is_initialized()`` is False until the script initialises the default group, which
  then joins the warm one; its ``destroy_process_group()`` leaves it warm; the groups it made
  are destroyed after it (:mod:`cpq.rank.pgroups`);
* the script runs in a fresh module namespace (``runpy``); ``sys.exit(n)`` ends the rank with
  ``n``, an exception with 1 and its traceback on stderr, as the interpreter would.

The rank reports the exit code as its value; a non-zero one is a failed rank (the broker's
table), never retried. State a script leaves that the next launch would see (threads still
running) makes the rank unfit: the group is recycled (:func:`leftover`).
"""

from __future__ import annotations

import builtins
import importlib.machinery
import os
import runpy
import sys
import tempfile
import threading
import time
import traceback
import types
from typing import Any

from cpq import environ
from cpq.rank import exits
from cpq.rank.items import ItemRun

CPQ_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

TARGET = "cpq.rank.script:run_script"

#: Why this rank must not serve another launch ("" when it may): read after the task.
leftover = ""

#: ``sys.path`` as the last launch left it (its script's folder first).
last_path: list[str] = []
#: ``sys.path`` as the interpreter built it for this rank, less what a new worker would
#: have otherwise: the folder the rank started in (``-m``) and ``PYTHONPATH``'s entries.
_interpreter_path: list[str] = []


def remember_interpreter_path() -> None:
    """At the rank's start, before it adds its import roots (:func:`worker_path`)."""
    given = set(environ.pythonpath_entries(os.environ.get("PYTHONPATH", ""), os.getcwd()))
    _interpreter_path[:] = [p for p in sys.path[1:] if p not in given]


def worker_path(first: str) -> list[str]:
    """``sys.path`` of a new ``python SCRIPT`` worker in this environment: ``first`` (the
    script's folder), the entries of ``PYTHONPATH`` (as the caller's, which the spec
    carries), the interpreter's own. A module in the caller's working directory is then
    importable only if it would be under torchrun (the directory is on ``PYTHONPATH``, or the
    script's own)."""
    entries = environ.pythonpath_entries(os.environ.get("PYTHONPATH", ""), os.getcwd())
    rest = _interpreter_path or sys.path[1:]  # not remembered: a test of this module alone
    return list(dict.fromkeys([first, *entries, *rest]))


def run_script(
    argv: list[str], module: bool, cwd: str, run_id: str, nproc: int, local_rank_arg: bool = False
) -> ItemRun:
    """Run ``argv[0]`` (a path, or a module name when ``module``) with ``argv[1:]``;
    ``local_rank_arg``: the script gets ``--local-rank=<r>`` first, as
    ``torch.distributed.launch`` passes it."""
    global leftover
    from cpq.rank import pgroups

    os.chdir(cwd)
    error_file = os.path.join(tempfile.mkdtemp(prefix="cpq-torchrun-"), "error.json")
    os.environ.update(
        {
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_ERROR_FILE": error_file,
            "GROUP_RANK": "0",
            "ROLE_NAME": "default",
            "ROLE_RANK": os.environ.get("RANK", "0"),
            "ROLE_WORLD_SIZE": os.environ.get("WORLD_SIZE", str(nproc)),
            "GROUP_WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": str(nproc),
        }
    )
    threads_before = set(threading.enumerate())
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = list(argv)
    if local_rank_arg:
        sys.argv.insert(1, f"--local-rank={os.environ.get('LOCAL_RANK', '0')}")
    sys.path[:] = worker_path(cwd if module else os.path.dirname(os.path.abspath(argv[0])))
    groups_before = {id(pg) for pg in pgroups.made_groups()}
    code, text = 0, ""
    with pgroups.as_fresh_worker(), exits.exit_raises():
        try:
            if module:
                runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
            elif os.path.isfile(argv[0]):
                _run_file(argv[0])
            else:  # a directory or a zip file with a __main__.py
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exc:
            code, text = _exit_code(exc)
        except exits.HardExit as exc:  # os._exit(n): the worker's status, without its death
            code = exc.code
        except BaseException as exc:  # what the interpreter prints, and its status
            text = _uncaught(exc, module, pgroups.script_initialised)
            sys.stderr.write(text)
            sys.stderr.flush()
            code = 1
        finally:
            # Its top-level code ran as __main__, which the rank's own __main__ replaces
            # again: its atexit handlers run at the launch's boundary (cpq.rank.exits).
            exits.gone.update(("__main__", "__mp_main__"))
            last_path[:] = sys.path  # where its imports were found (cpq.rank.ahead)
            sys.argv = saved_argv
            sys.path[:] = saved_path
    ended = time.time()  # when a worker process would have exited (the failure's time)
    pgroups.caller_done(groups_before)  # what the script made and left
    alive = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    # Named (a plugin's daemon thread, say pytest-rerunfailures' "run_server"), so that
    # whoever reads why the group was recycled can tell whose thread it was.
    names = ", ".join(sorted(t.name for t in alive)[:5]) + (", ..." if len(alive) > 5 else "")
    leftover = f"the script left {len(alive)} thread(s) running ({names})" if alive else ""
    if pgroups.launch_ended(code != 0, nproc):
        # A failed worker's process ends and its connections close: peers waiting for it
        # in a collective fail at once with their own traceback, as under torchrun.
        pgroups.close_as_dead_worker()
        leftover = f"its script exited {code}: its process groups were closed"
    if code == 0:
        return ItemRun("passed", value=0)
    line = f"exit code {code} (pid: {os.getpid()}, at {ended:.3f})"
    return ItemRun("failed", error=("SystemExit", line, text[-8000:]), value=code)


def _run_file(path: str) -> None:
    """``python path``: the file as ``__main__``, its ``__file__`` absolute and
    ``sys.argv[0]`` as given (runpy's ``run_path`` sets both to the path it was given)."""
    absolute = os.path.abspath(path)
    with open(absolute, "rb") as source:
        code = compile(source.read(), absolute, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=absolute,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", absolute),
        __spec__=None,
        __package__=None,
        __builtins__=builtins,
    )
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _uncaught(exc: BaseException, module: bool, initialised: bool) -> str:
    """What the interpreter of a torchrun worker prints for an uncaught exception: the
    traceback from the script's frame (``-m``: after runpy's two frames, as ``python -m``
    shows them), each line prefixed ``[rank<r>]: `` once the script initialised a process
    group (torch's ``init_process_group`` installs that ``sys.excepthook``)."""
    text = "".join(traceback.format_exception(type(exc), exc, _script_tb(exc)))
    header = "Traceback (most recent call last):\n"
    at = text.rfind(header)
    if module and at >= 0:
        at += len(header)
        text = text[:at] + _RUNPY_FRAMES + text[at:]
    if initialised:
        prefix = f"[rank{os.environ.get('RANK', '0')}]: "
        text = "\n".join(prefix + line if line else "" for line in text.split("\n"))
    return text


def _call_line(function: Any, callee: str) -> int:
    """The line of ``function`` that calls ``callee`` (for runpy's frames, which are frozen)."""
    import dis

    seen = False
    for instruction in dis.get_instructions(function):
        if instruction.argval == callee and instruction.opname.startswith("LOAD"):
            seen = True
        elif seen and instruction.opname.startswith("CALL"):
            positions = getattr(instruction, "positions", None)
            line = getattr(positions, "lineno", None) or instruction.starts_line
            return int(line or 0)
    return 0


_RUNPY_FILE = (
    "<frozen runpy>"
    if runpy.__spec__ and runpy.__spec__.origin == "frozen"
    else (runpy.__file__ or "runpy.py")
)
_RUNPY_FRAMES = (
    f'  File "{_RUNPY_FILE}", line {_call_line(getattr(runpy, "_run_module_as_main"), "_run_code")}'  # noqa: B009
    ", in _run_module_as_main\n"
    f'  File "{_RUNPY_FILE}", line {_call_line(getattr(runpy, "_run_code"), "exec")}'  # noqa: B009
    ", in _run_code\n"
)


def _script_tb(exc: BaseException) -> Any:
    """``exc``'s traceback from the script's first frame on (cpq's and runpy's cut), as
    the interpreter's own report of an uncaught exception starts."""
    tb = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename.startswith(CPQ_DIR)
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy>")
        or tb.tb_frame.f_code.co_filename == runpy.__file__
    ):
        tb = tb.tb_next
    return tb


def _exit_code(exc: SystemExit) -> tuple[int, str]:
    """``sys.exit``'s status as the interpreter turns it into one: None 0, an int itself,
    anything else printed to stderr and 1."""
    arg: Any = exc.code
    if arg is None:
        return 0, ""
    if isinstance(arg, int):
        return arg, ""
    sys.stderr.write(f"{arg}\n")
    sys.stderr.flush()
    return 1, str(arg)
