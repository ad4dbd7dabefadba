"""``pytest --cpq-torchrun``: every torchrun launch a test makes runs on a warm group.

Suites that launch ``torchrun script.py`` per test case (Transformer Engine's distributed
tests) need no edit: with ``--cpq-torchrun`` (ini ``cpq_torchrun``, env ``CPQ_TORCHRUN=1``)
this process puts a folder in front of ``PATH`` and ``PYTHONPATH`` for everything the tests
start:

* ``torchrun`` there is a two-line shell script: ``python -m cpq torchrun "$@"``;
* ``sitecustomize.py`` there is a start-up hook every Python child runs: an interpreter
  started as ``python -m torch.distributed.run`` (or ``torch.distributed.launch``, whose
  ``--local-rank`` argument each rank then gets) becomes ``python -m cpq torchrun`` with the
  same arguments; any other interpreter pays a look at its command line and a search of
  ``sys.path`` for the ``sitecustomize`` this one shadows, which it then runs.

``cpq torchrun`` itself (:mod:`cpq.client.torchrun`) runs what it cannot make faithful with
the real torchrun, with ``CPQ_TORCHRUN_REAL=1`` so the hook lets that one through.
Not routed: ``torch.distributed.run.run(args)`` called inside a test's own process (as
``accelerate launch`` does): that runs the real torchrun.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import pytest

from cpq import paths

ENV_VAR = "CPQ_TORCHRUN"
#: Set for a launch cpq hands to the real torchrun: the start-up hook leaves it alone.
REAL_VAR = "CPQ_TORCHRUN_REAL"

_SHIM = """#!/bin/sh
# cpq (pytest --cpq-torchrun): this launch runs on a warm group
exec {python} -m cpq torchrun "$@"
"""

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
    os.execv(sys.executable, [sys.executable, "-m", "cpq", "torchrun", *args])


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
        self.folder = str(paths.state_dir() / f"torchrun-route-{digest}")
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        _write(os.path.join(self.folder, "torchrun"), _SHIM.format(python=sys.executable), 0o755)
        _write(os.path.join(self.folder, "sitecustomize.py"), _HOOK.replace("{real}", REAL_VAR))
        self.saved = {name: os.environ.get(name) for name in ("PATH", "PYTHONPATH")}
        for name in ("PATH", "PYTHONPATH"):
            before = os.environ.get(name, "")
            os.environ[name] = self.folder + (os.pathsep + before if before else "")

    def close(self) -> None:
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
