"""The descriptors a shell passes a pytest process, given to the fork at their own numbers.

A process gets more than descriptors 0-2 from whoever starts it: ``make -j`` passes its
jobserver's pipe (``MAKEFLAGS=--jobserver-auth=3,4``), ``pytest 3>log`` a file,
``<(...)`` a pipe at ``/dev/fd/63``, a CI runner or an IDE whatever it left inheritable. A
fresh ``pytest`` has them at those numbers, and its conftests and the subprocesses its tests
start may use them. The fork that runs a handed-over session must have them too, at the
same numbers — but the warm caller has descriptors of its own there: its log, its sockets,
whatever the libraries it imported opened. Those cannot be moved (a library knows its
descriptor by number).

So the warm caller **reserves** numbers 3 to :data:`TOP` before it opens anything: each is
a close-on-exec duplicate of one ``/dev/null`` descriptor, and what it opens afterwards
lands above them. The caller sends its inheritable descriptors above 2 (``SCM_RIGHTS``)
with their numbers; the fork puts each at its number over a placeholder
(:func:`install`) and closes the placeholders left, so that its next ``open`` gets the
lowest free number, as a fresh process's would. A descriptor above :data:`TOP`, or a warm
caller that could not reserve the number (its descriptor limit too low), refuses the
hand-over: the session then runs in its own process.
"""

from __future__ import annotations

import contextlib
import os
import resource

#: The highest number a caller's descriptor may have to be handed over. 255 covers the
#: shells' ``/dev/fd/63`` and the numbers harnesses pick; the reservation costs 253
#: descriptors of the warm caller's limit (at least :data:`_LIMIT_NEEDED`).
TOP = 255
#: The warm caller reserves only when its soft descriptor limit leaves this many.
_LIMIT_NEEDED = 1024

#: The reserved numbers (empty: nothing reserved, only 0-2 can be handed over).
_placeholders: frozenset[int] = frozenset()
#: ``(st_dev, st_ino)`` of ``/dev/null``: a placeholder is checked still to be one.
_null: tuple[int, int] = (0, 0)


def reserve() -> frozenset[int]:
    """The warm caller's first act: numbers 3 to :data:`TOP` that are free become
    placeholders (close-on-exec, so no child inherits them and ``os.execv`` frees them)."""
    global _placeholders, _null
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < _LIMIT_NEEDED:
        return _placeholders
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    taken = set()
    for number in range(3, TOP + 1):
        if number == null or _is_open(number):
            continue
        os.dup2(null, number, inheritable=False)
        taken.add(number)
    stat = os.fstat(null)
    if null > TOP:
        os.close(null)
    else:
        taken.add(null)  # it lies in the range: it is a placeholder like the others
    _placeholders, _null = frozenset(taken), (stat.st_dev, stat.st_ino)
    return _placeholders


def refusal(numbers: list[int]) -> str:
    """Why a caller's descriptors cannot be given their numbers in a fork ("" when they
    can): 0-2 first, each number once, every other a placeholder that is still one."""
    if numbers[:3] != [0, 1, 2]:
        return f"the descriptors must start with 0, 1, 2, not {numbers[:3]}"
    if len(set(numbers)) != len(numbers):
        return f"a descriptor number given twice: {numbers}"
    for number in numbers[3:]:
        if number not in _placeholders or not _still_placeholder(number):
            return (
                f"its descriptor {number} cannot be given that number here "
                f"(numbers 3-{TOP} reserved: {'yes' if _placeholders else 'no'})"
            )
    return ""


def install(received: list[int], numbers: list[int]) -> None:
    """In the fork: each received descriptor at its number (inheritable, as the caller's
    were), then the placeholders left closed. :func:`refusal` said they fit."""
    for fd, number in zip(received, numbers, strict=True):
        if fd != number:
            os.dup2(fd, number, inheritable=True)
            os.close(fd)
    given = set(numbers)
    for number in _placeholders - given:
        with contextlib.suppress(OSError):
            os.close(number)


def _is_open(number: int) -> bool:
    try:
        os.fstat(number)
    except OSError:
        return False
    return True


def _still_placeholder(number: int) -> bool:
    try:
        stat = os.fstat(number)
    except OSError:
        return False
    return (stat.st_dev, stat.st_ino) == _null
