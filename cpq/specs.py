"""Pool specs from a caller's view: its interpreter, import roots and start variables.

A shared leaf: the client builds the spec of every task it submits here, and the broker's
command line builds its ``--warm`` specs the same way, so a warmed group matches the tasks
that later ask for it (docs/design.md "Words": spec).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from typing import Any

from cpq import environ
from cpq.protocol import PoolSpec


class BadRequest(ValueError):
    """The broker (or the client, before sending) refused a request as malformed."""


def default_roots(cwd: str | None = None, env: Mapping[str, str] | None = None) -> list[str]:
    """Import roots a plain client sends: its working directory and ``PYTHONPATH`` (of
    ``cwd`` and ``env`` when given: a process the launch relay serves)."""
    cwd = os.getcwd() if cwd is None else cwd
    return list(dict.fromkeys([cwd, *pythonpath_roots(cwd, env)]))


def pythonpath_roots(cwd: str | None = None, env: Mapping[str, str] | None = None) -> list[str]:
    """``PYTHONPATH``'s entries, absolute, each once, without cpq's routing folder: the
    import roots of a launch (a new worker does not import from its working directory)."""
    cwd = os.getcwd() if cwd is None else cwd
    env = os.environ if env is None else env
    entries = environ.pythonpath_entries(env.get("PYTHONPATH", ""), cwd)
    # without cpq's own routing folder (environ.fold_paths)
    return list(dict.fromkeys(e for e in entries if not environ.is_route_folder(e)))


def interpreter() -> str:
    """``sys.executable``, named canonically within its own bin directory.

    ``python``, ``python3`` and ``python3.11`` of one environment are symlinks to one binary
    and must share warm groups (a console script runs under one name, ``python -m pytest``
    under another); a venv's interpreter lives in another directory and stays distinct.
    """
    return _canonical(sys.executable)


@functools.cache
def _canonical(exe: str) -> str:
    """Cached: a submit should not cost a realpath per symlink (several syscalls each)."""
    real = os.path.realpath(exe)
    for name in ("python3", "python"):
        candidate = os.path.join(os.path.dirname(exe), name)
        if os.path.exists(candidate) and os.path.realpath(candidate) == real:
            return candidate
    return exe


def make_spec(
    world_size: int,
    env: dict[str, str] | None = None,
    roots: list[str] | None = None,
    backend: str = "",
    python: str | None = None,
    caller_env: Mapping[str, str] | None = None,
) -> PoolSpec:
    """The pool spec of a task: ``env`` (the task's explicit overrides) on top of the start
    variables of ``caller_env`` (default: this process's environment; see :mod:`cpq.environ`)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool):
        raise BadRequest(f"world_size must be an int, got {world_size!r}")
    env = env or {}
    bad = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise BadRequest(f"env values must be strings: {bad!r}")
    launcher = sorted(k for k in env if environ.is_launcher_var(k))
    if launcher:
        raise BadRequest(f"env cannot set torchrun's own variables: {launcher}")
    start, _ = environ.split(os.environ if caller_env is None else caller_env)
    merged = {**start, **env}
    python = python or interpreter()
    roots = list(roots) if roots is not None else default_roots()
    key = (world_size, python, tuple(roots), tuple(sorted(merged.items())), backend)
    cached = _SPECS.get(key)
    if cached is not None:
        return cached  # PoolSpec is frozen: one per distinct spec, not one per task
    try:
        spec = PoolSpec(
            world_size=world_size,
            python=python,
            roots=roots,
            env=[[k, v] for k, v in key[3]],
            backend=backend,
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if len(_SPECS) >= 256:
        _SPECS.clear()
    _SPECS[key] = spec
    return spec


_SPECS: dict[tuple[Any, ...], PoolSpec] = {}
