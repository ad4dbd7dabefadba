"""Variables read while a module was being imported bind the group (docs/design.md,
"Fidelity: import-time environment").

``MODE = os.environ.get("TPLIB_MODE", "unset")`` at module level keeps the value of the
session that first imported the module in a warm rank; a fresh ``torchrun`` would read the
caller's value. So from the rank's start on, every read of ``os.environ``, ``os.getenv``
and ``os.environb`` made while an import is in progress is recorded with the value it saw
(or its absence), and before each task the rank compares those values with the task's
environment. A difference refuses the task as stale, like a changed file
(:mod:`cpq.rank.freshness`), and the broker runs it on a fresh group.

How reads are seen: the class of the one ``os.environ`` (and ``os.environb``) object is
swapped for a subclass whose ``__getitem__`` records (``get``, ``in``, ``getenv``, copies
all go through it), so references taken before the swap (``from os import environ``) are
covered too. "An import is in progress" is ``importlib._bootstrap._module_locks`` being
non-empty: CPython holds a per-module lock for exactly the time a module executes (a dict
truth test, ~30 ns); the marker tests' own files, which :mod:`cpq.rank.pytest_task`
executes itself, count through :func:`importing`.

Two kinds of binding:

* read during the rank's start-up (cpq, torch, ``CPQ_PRELOAD``): the group's start
  environment is the spec's, the same for every group of the spec, so a fresh group would
  read the same value; a caller whose value differs is refused with a message naming the
  variable and ``CPQ_SPEC_ENV`` (which makes it a spec variable: its groups start with the
  caller's value);
* read during a task's imports: bound to the task's value; another value means a fresh
  group (a spare when there is one).

A variable the process sets itself while importing (``os.environ.setdefault``) is the
library's, not the caller's: it binds nothing. A path list (a name ending in ``PATH``)
compares as a spec keeps it (:func:`cpq.environ.fold_paths`): the routing folder that
``pytest --cpq-torchrun`` puts in front of ``PATH`` holds only cpq's ``torchrun`` shim, so
a launch whose ``PATH`` differs by it alone runs on the warm group (before, every launch
session refused its first group: something torch imports reads ``PATH``).
"""

from __future__ import annotations

import importlib._bootstrap as _bootstrap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_locks: dict[str, Any] = _bootstrap._module_locks  # type: ignore[attr-defined]
_own_imports = [0]

#: name -> the value an import saw (None: absent). Filled by the swapped classes.
bound: dict[str, str | None] = {}
#: Names bound while the rank started (before :func:`start_done`).
start_names: set[str] = set()
#: Names an import set itself (never bound).
self_set: set[str] = set()
#: ``bound`` as ``os.environ``'s own store holds it (bytes), for a cheap comparison.
_expected: dict[bytes, bytes | None] = {}
_starting = [True]
#: While :func:`diverted` runs: every read an import makes (name -> the value it saw first),
#: kept apart from ``bound`` (imports made ahead of a session, :mod:`cpq.rank.ahead`).
_diverted: list[dict[str, str | None]] = []


def _importing() -> bool:
    return bool(_locks) or _own_imports[0] > 0


#: Variables of the test harness, not of the code under test: they change with every test
#: (``PYTEST_CURRENT_TEST``) or are cpq's and pytest's own wiring. A module that copies the
#: whole environment at import must not cost a fresh group per test for them.
HARNESS_PREFIXES = ("PYTEST_", "CPQ_", "COV_CORE_")
#: What the shell and the terminal keep about where and how a command was typed: they change
#: with a ``cd`` (``OLDPWD``, ``PWD``), a script around the command (``SHLVL``, ``_``), a new
#: terminal or connection. A module that walks the whole environment at import (tqdm,
#: imported by torch, looks for its ``TQDM_`` variables so) reads them all; those reads bind
#: nothing: a ``cd`` elsewhere and back must not refuse a warm caller or a warm group. Read by
#: name, they bind as any variable does.
SHELL_NOISE = frozenset(
    {
        "OLDPWD",
        "PWD",
        "SHLVL",
        "_",
        "SSH_CLIENT",
        "SSH_CONNECTION",
        "SSH_TTY",
        "TERM_SESSION_ID",
        "ITERM_SESSION_ID",
        "WINDOWID",
        "TMUX_PANE",
        "STY",
        "XDG_SESSION_ID",
    }
)
#: Walks of the environment in progress (``os.environ.items()``, ``dict(os.environ)``).
_walks = [0]


class _Walk:
    """One walk of the environment during an import: the values it read, held until it
    ends, and the prefixes its keys were tested for (``k.startswith("TQDM_")``)."""

    def __init__(self) -> None:
        self.read: list[tuple[str, str | None]] = []
        self.prefixes: set[str] = set()
        self.keys: list[_WalkedKey] = []
        self.tested = 0

    def end(self) -> None:
        """Bind what the walk read — only the variables a prefix it tested every key for
        selects, when it tested each key so (tqdm's ``envwrap`` looks for its ``TQDM_``
        variables this way: the rest of the environment binds nothing)."""
        filtered = bool(self.prefixes) and self.tested >= len(self.keys)
        for key in self.keys:  # what the walk's keys became tells it nothing more
            del key._walk
        for name, value in self.read:
            if not filtered or name.startswith(tuple(self.prefixes)):
                _record(name, value)


#: The import-time walks in progress, innermost last.
_walks_open: list[_Walk] = []


class _WalkedKey(str):
    """A key an import-time walk yields: tells its walk the prefixes it is tested for."""

    _walk: _Walk | None = None

    def startswith(self, prefix: Any, *args: Any) -> bool:
        walk = self._walk
        if walk is not None and not args:
            found = {prefix} if isinstance(prefix, str) else set(prefix)
            if all(isinstance(p, str) for p in found):
                walk.prefixes |= found
                walk.tested += 1
        return str.startswith(self, prefix, *args)


def _record(name: str, value: str | None) -> None:
    if _walks[0] and name in SHELL_NOISE:
        return
    if _diverted:
        if not name.startswith(HARNESS_PREFIXES):
            _diverted[-1].setdefault(name, value)
        return
    if name not in bound and name not in self_set and not name.startswith(HARNESS_PREFIXES):
        bound[name] = value
        _expected[os.fsencode(name)] = None if value is None else os.fsencode(value)
        if _starting[0]:
            start_names.add(name)


class _TrackedEnviron(os._Environ):  # type: ignore[type-arg]
    """``os.environ`` that records what imports read (see the module docstring)."""

    __slots__ = ()

    def __getitem__(self, key: Any) -> Any:
        try:
            value = super().__getitem__(key)
        except KeyError:
            if _importing():
                _record(_name(key), None)
            raise
        if _importing():
            text = value if isinstance(value, str) else os.fsdecode(value)
            walk = getattr(key, "_walk", None)
            if walk is not None and walk in _walks_open:
                walk.read.append((_name(key), text))  # bound when the walk ends
            else:
                _record(_name(key), text)
        return value

    def __iter__(self) -> Any:
        _walks[0] += 1  # what is read until the walk ends is read by walking (SHELL_NOISE)
        walk = _Walk() if _importing() else None
        try:
            if walk is None:
                yield from super().__iter__()
                return
            _walks_open.append(walk)
            for key in super().__iter__():
                if type(key) is str:
                    key = _WalkedKey(key)
                    key._walk = walk
                    walk.keys.append(key)
                yield key
        finally:
            if walk is not None:
                _walks_open.remove(walk)
                walk.end()
            _walks[0] -= 1

    def __setitem__(self, key: Any, value: Any) -> None:
        if _importing() and not _diverted:  # diverted: the warm-up refuses such imports
            name = _name(key)
            self_set.add(name)
            _forget(name)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        if _importing() and not _diverted:  # diverted: the warm-up refuses such imports
            name = _name(key)
            self_set.add(name)
            _forget(name)
        super().__delitem__(key)


@contextmanager
def diverted() -> Iterator[dict[str, str | None]]:
    """Record what the imports inside read into the dict yielded, binding nothing: a
    session that takes those imports over binds them then (:func:`adopt`)."""
    reads: dict[str, str | None] = {}
    _diverted.append(reads)
    try:
        yield reads
    finally:
        _diverted.pop()


def adopt(reads: dict[str, str | None]) -> None:
    """Bind what imports made ahead of this session read, as if the session's own import
    had read it now (the values were checked equal to the session's first)."""
    for name, value in reads.items():
        _record(name, value)


def stale_read(reads: dict[str, str | None]) -> str:
    """The first variable of ``reads`` whose value differs now ("" when none does)."""
    data: dict[bytes, bytes] = os.environ._data  # type: ignore[attr-defined]
    for name, value in reads.items():
        key = os.fsencode(name)
        then = None if value is None else os.fsencode(value)
        now = data.get(key)
        if now != then and not _same_path_list(key, now, then):
            return name
    return ""


def _forget(name: str) -> None:
    bound.pop(name, None)
    _expected.pop(os.fsencode(name), None)
    start_names.discard(name)


def _name(key: Any) -> str:
    return key if isinstance(key, str) else os.fsdecode(key)


def install() -> None:
    """Start recording (the first thing a rank does)."""
    for mapping in (os.environ, getattr(os, "environb", None)):
        if mapping is not None and type(mapping) is os._Environ:
            mapping.__class__ = _TrackedEnviron


def uninstall() -> None:
    """Stop recording and forget what was recorded (tests)."""
    for mapping in (os.environ, getattr(os, "environb", None)):
        if mapping is not None and type(mapping) is _TrackedEnviron:
            mapping.__class__ = os._Environ  # type: ignore[assignment]
    for record in (bound, start_names, self_set, _expected):
        record.clear()
    _starting[0] = True


def start_done() -> None:
    """The rank is ready: later bindings are a task's."""
    _starting[0] = False


@contextmanager
def importing() -> Iterator[None]:
    """Count what runs inside as an import (a test file executed by path)."""
    _own_imports[0] += 1
    try:
        yield
    finally:
        _own_imports[0] -= 1


def differs(environ: dict[bytes, bytes] | None = None) -> tuple[str, bool]:
    """``(first bound variable whose value differs now, whether it was bound at start)``;
    ``("", False)`` when none does. Reads the environment's own store, not recording."""
    data: dict[bytes, bytes] = os.environ._data if environ is None else environ  # type: ignore[attr-defined]
    for key, value in _expected.items():
        now = data.get(key)
        if now != value and not _same_path_list(key, now, value):
            name = os.fsdecode(key)
            return name, name in start_names
    return "", False


def _same_path_list(key: bytes, now: bytes | None, then: bytes | None) -> bool:
    """Two values of a path list that search the same folders but cpq's routing folder."""
    if not key.endswith(b"PATH"):
        return False
    from cpq.environ import path_list

    def folded(value: bytes | None) -> str | None:
        return path_list(None if value is None else os.fsdecode(value))

    return folded(now) == folded(then)
