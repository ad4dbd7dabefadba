"""``pytest --cpq-torchrun``: every torchrun launch a test makes runs on a warm group.

Suites that launch ``torchrun script.py`` per test case (Transformer Engine's distributed
tests) need no edit: with ``--cpq-torchrun`` (ini ``cpq_torchrun``, env ``CPQ_TORCHRUN=1``)
this process puts a folder in front of ``PATH`` and ``PYTHONPATH`` for everything the tests
start:

* ``torchrun`` there is a two-line shell script running the launch shim (``python -sS
  cpq_launch.py "$@"``), which hands the launch to this process's launch relay
  (:mod:`cpq.client.launch_relay`) or else runs ``python -m cpq torchrun "$@"``;
* ``sitecustomize.py`` there is a start-up hook every Python child runs: an interpreter
  started as ``python -m torch.distributed.run`` (or ``torch.distributed.launch``, whose
  ``--local-rank`` argument each rank then gets) becomes the shim with the
  same arguments; any other interpreter pays a look at its command line and a search of
  ``sys.path`` for the ``sitecustomize`` this one shadows, which it then runs.

``cpq torchrun`` itself (:mod:`cpq.client.torchrun`) runs what it cannot make faithful with
the real torchrun, with ``CPQ_TORCHRUN_REAL=1`` so the hook lets that one through.
``torch.distributed.run.run(args)`` called inside the test's own process (as ``accelerate
launch`` does) is routed too: once ``torch.distributed.run`` is loaded here, its ``run`` is
replaced by one that turns the parsed arguments back into a command line for ``cpq
torchrun`` (what it does not know runs the real ``run``) and raises torchrun's
``ChildFailedError`` when a rank failed, as the real one does.

A launch runs in a child process, so the seconds it waited for its group to start (the
broker measures them) would stay there and count as the test's own time; each launch
appends them, with the test that launched it (``PYTEST_CURRENT_TEST``) and its groups, to
the file ``CPQ_LAUNCH_WAITS`` names, and :meth:`Routing.fold` hands them to the session as
a ``cpq.run``'s are (docs/design.md "Fan-out").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import sys
from typing import Any

import pytest

from cpq import environ, paths
from cpq.client.launch_relay import RELAY_VAR, SHIM, LaunchRelay
from cpq.client.run_routing import route_in_process, route_on_import, run_argv
from cpq.client.torchrun import WAITS_VAR, endpoint_of, report_wait

__all__ = [
    "WAITS_VAR",
    "Routing",
    "add_options",
    "enabled",
    "report_wait",
    "route_in_process",
    "run_argv",
]

ENV_VAR = "CPQ_TORCHRUN"
#: Set for a launch cpq hands to the real torchrun: the start-up hook leaves it alone.
REAL_VAR = "CPQ_TORCHRUN_REAL"
_SHIM = """#!/bin/sh
# cpq (pytest --cpq-torchrun): this launch runs on a warm group (cpq/client/launch_relay.py)
exec {python} -sS {shim} "$@"
"""
#: The launch shim's file in the route folder (launch_relay.SHIM).
SHIM_FILE = "cpq_launch.py"

_HOOK = '''"""cpq's start-up hook (pytest --cpq-torchrun): see cpq/client/launches.py."""
import os
import sys


def _cpq_route():
    argv = getattr(sys, "orig_argv", None) or []
    if "-m" not in argv or os.environ.get("{real}"):
        return
    at = argv.index("-m")
    module = argv[at + 1] if at + 1 < len(argv) else ""
    if module not in ("torch.distributed.run", "torch.distributed.launch"):
        return
    args = argv[at + 2 :]
    if module == "torch.distributed.launch":
        args = ["--cpq-launch-local-rank", *args]
    shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "{shim_file}")
    os.execv(sys.executable, [sys.executable, "-sS", shim, *args])


def _cpq_chain():
    """Run the sitecustomize this one shadows, as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


class _CpqRouteRun:
    """``torch.distributed.run.run(args)`` in this process (``accelerate launch``) runs
    ``cpq torchrun``: cpq is imported only when that module is."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch.distributed.run":
            return None
        sys.meta_path.remove(self)
        try:
            from cpq.client.run_routing import route_on_import
        except Exception:
            return None
        return route_on_import().find_spec(fullname, path, target)


# Not in cpq's own groups (their agent runs torchrun's code) nor in a real torchrun's workers.
if not any(os.environ.get(v) for v in ("{real}", "CPQ_GROUP_ID", "TORCHELASTIC_RUN_ID")):
    sys.meta_path.insert(0, _CpqRouteRun())
_cpq_route()
_cpq_chain()
'''


def add_options(parser: pytest.Parser, group: Any) -> None:
    group.addoption(
        "--cpq-torchrun",
        action="store_true",
        default=None,
        help="run every torchrun launch the tests make on a warm group (CPQ_TORCHRUN=1)",
    )
    parser.addini("cpq_torchrun", "route the tests' torchrun launches to cpq", type="bool")


def enabled(config: pytest.Config) -> bool:
    if config.getoption("cpq_torchrun", None):
        return True
    env = os.environ.get(ENV_VAR)
    if env is not None:
        return env not in ("", "0")
    return bool(config.getini("cpq_torchrun"))


class Routing:
    """The folder in front of ``PATH`` and ``PYTHONPATH`` while the session runs.

    One folder per user and interpreter, in cpq's private state directory: its path is part
    of every launch's environment (``PYTHONPATH`` is a start variable, so part of the spec),
    and a folder per session would give every session a spec, and groups, of its own."""

    def __init__(self) -> None:
        digest = hashlib.sha256(sys.executable.encode()).hexdigest()[:8]
        # its name tells specs to leave it out (environ.fold_paths)
        self.folder = str(paths.state_dir() / f"{environ.ROUTE_FOLDER_PREFIX}{digest}")
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        shim = os.path.join(self.folder, SHIM_FILE)
        _write(shim, SHIM)
        command = _SHIM.format(python=shlex.quote(sys.executable), shim=shlex.quote(shim))
        _write(os.path.join(self.folder, "torchrun"), command, 0o755)
        hook = _HOOK.replace("{real}", REAL_VAR).replace("{shim_file}", SHIM_FILE)
        _write(os.path.join(self.folder, "sitecustomize.py"), hook)
        self.saved = {
            name: os.environ.get(name) for name in ("PATH", "PYTHONPATH", WAITS_VAR, RELAY_VAR)
        }
        for name in ("PATH", "PYTHONPATH"):
            before = os.environ.get(name, "")
            os.environ[name] = self.folder + (os.pathsep + before if before else "")
        self.waits = os.path.join(self.folder, f"waits-{os.getpid()}-{id(self):x}.jsonl")
        os.environ[WAITS_VAR] = self.waits  # a task variable: no part of any spec
        # the shims hand their launches to this process's client (launch_relay.py)
        self.relay = LaunchRelay.start(endpoint_of(os.environ))
        if self.relay is not None:
            os.environ[RELAY_VAR] = self.relay.path
        else:
            os.environ.pop(RELAY_VAR, None)
        self.offset = 0
        # accelerate launch in this process imports torch.distributed.run during the test
        self.hook = route_on_import()

    def fold(self, waits: dict[str, float], groups: set[str]) -> float:
        """Add the launches' waits reported since the last call to ``waits`` (by test id)
        and their groups to ``groups``; the seconds added."""
        try:
            with open(self.waits, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return 0.0
        end = data.rfind(b"\n") + 1
        self.offset += end
        added = 0.0
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
                test, wait = str(record["test"]), float(record["wait_s"])
            except (ValueError, KeyError, TypeError):
                continue
            waits[test] = waits.get(test, 0.0) + wait
            groups.update(str(g) for g in record.get("groups") or [])
            added += wait
        return added

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
        if self.hook in sys.meta_path:
            sys.meta_path.remove(self.hook)
        module = sys.modules.get("torch.distributed.run")
        real = getattr(getattr(module, "run", None), "__wrapped__", None)
        if (
            module is not None
            and getattr(getattr(module, "run", None), "_cpq_routed", False)
            and real
        ):
            setattr(module, "run", real)  # noqa: B010
        with contextlib.suppress(OSError):
            os.unlink(self.waits)
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _write(path: str, text: str, mode: int = 0o644) -> None:
    """Write ``text`` unless the file holds it already (sessions share the folder)."""
    try:
        with open(path) as existing:
            if existing.read() == text:
                return
    except OSError:
        pass
    temporary = f"{path}.{os.getpid()}"
    with open(temporary, "w") as out:
        out.write(text)
    os.chmod(temporary, mode)
    os.replace(temporary, path)
