"""Whether a warm process fits a caller: the request's shape, and the variables what it
imported read or set, against the caller's (docs/design.md, "The warm caller").

The warm caller (:mod:`cpq.caller.server`) asks it of every caller before it forks, and
the session prepared ahead (:mod:`cpq.caller.prepared`) of the caller it is offered: one
rule for both, so that what a fork inherits is judged the same way whichever process
imported it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from cpq import environ
from cpq.caller import descriptors, wire
from cpq.rank import freshness, importenv, probes


class Refused(Exception):
    """Why a request is not served; ``fatal``: this process no longer serves anyone."""

    def __init__(self, why: str, fatal: bool = False) -> None:
        super().__init__(why)
        self.fatal = fatal


def misfit(
    theirs: Mapping[str, str],
    reads: Mapping[str, str | None],
    found: Mapping[str, str | None],
) -> str:
    """Why imports done here do not fit a caller whose variables are ``theirs`` ("" when
    they do): a variable they ``reads`` has another value there (None: unset), or one they
    set had, before they set it, another value than the caller's (``found``)."""
    for name, value in reads.items():
        if theirs.get(name) != value:
            return f"its imports read {name}, which differs for this session"
    for name, value in found.items():
        if theirs.get(name) != value:
            return f"its imports set {name}, which this session has otherwise"
    return ""


def check_fork(
    message: dict[str, Any],
    fds: list[int],
    watch: freshness.CodeWatch,
    reads: Mapping[str, str | None],
    found: Mapping[str, str | None],
    start_environ: Mapping[str, str],
) -> None:
    """What the warm caller checks of a caller before it forks for it (raises
    :class:`Refused`): the request; its files unchanged since ``watch`` saw them; what its
    imports ``reads`` and ``found`` (:func:`misfit`) and what they read natively; the start
    variables it was started with (``start_environ``); and that a fork can be made."""
    check_request(message, fds)
    changed = watch.changed()
    if changed:
        raise Refused(f"{changed} changed since it was imported", fatal=True)
    why = misfit(message["environ"], reads, found)
    if why:
        raise Refused(why)
    encoded = {os.fsencode(k): os.fsencode(v) for k, v in message["environ"].items()}
    variable = importenv.differs(encoded)[0]
    if variable:
        raise Refused(f"its imports read {variable}, which differs for this session")
    variable = start_var_differs(dict(start_environ), message["environ"])
    if variable:  # read natively at start (LD_PRELOAD, OMP_*, PYTHONHASHSEED): not seen above
        raise Refused(f"the start variable {variable} differs for this session")
    # A fork copies one thread. Native threads a library starts at import (torch's) are
    # what every fork-based worker of that library lives with (torch's DataLoader); a
    # Python thread, or CUDA initialised, would leave the fork broken.
    if threading.active_count() != 1:
        raise Refused("it runs a Python thread: a fork would copy one", fatal=True)
    if probes.cuda_initialised():
        raise Refused("CUDA is initialised: a fork could not use it", fatal=True)


def check_request(message: dict[str, Any], fds: list[int]) -> None:
    """What any warm caller refuses: a malformed request, its descriptors' numbers, another
    interpreter."""
    check_shape(message)
    numbers = message.get("fds", [0, 1, 2])
    if not (isinstance(numbers, list) and all(type(n) is int for n in numbers)):
        raise Refused("fds must be a list of descriptor numbers")
    if len(numbers) != len(fds):
        raise Refused(f"{len(numbers)} descriptor numbers for {len(fds)} descriptors")
    why = descriptors.refusal(numbers)
    if why:
        raise Refused(why)
    if message.get("interpreter") != wire.interpreter_identity():
        raise Refused("another interpreter or other interpreter options")


def check_shape(message: dict[str, Any]) -> None:
    def texts(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(x, str) for x in value)

    if not (texts(message.get("argv")) and texts(message.get("path"))):
        raise Refused("argv and path must be lists of text")
    if not isinstance(message.get("cwd"), str) or not isinstance(message.get("umask"), int):
        raise Refused("cwd must be text and umask a number")
    environ = message.get("environ")
    if not isinstance(environ, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in environ.items()
    ):
        raise Refused("environ must map text to text")
    streams = message.get("streams")
    if not isinstance(streams, list) or len(streams) != 3:
        raise Refused("streams must describe stdin, stdout and stderr")


def start_var_differs(mine: dict[str, str], theirs: dict[str, str]) -> str:
    """The first start variable (``environ.is_start_var``) whose value differs ("" when
    none does)."""
    for name in sorted(set(mine) | set(theirs)):
        if environ.is_start_var(name) and mine.get(name) != theirs.get(name):
            return name
    return ""
