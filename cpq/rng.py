"""The pytest process's ``random``/``numpy`` global state, carried into the ranks.

In a plain run the test body draws from the pytest process's global generators, which a
plugin may have set just before it (pytest-randomly reseeds ``random`` and numpy's legacy
global ``RandomState`` before every test from ``--randomly-seed``; a user's fixture may call
``random.seed``). For the body's draws on every rank to equal that run's, the client reads
the state at submit time and each rank installs it before the body
(:func:`cpq.rank.reset.reset_state`).

"A plugin set it" is detected as: the state at submit differs from the state the process
had when cpq's plugin was configured (numpy's: when first seen, at the latest at the end of
collection; :class:`Snapshot`). A seed or a draw since counts alike: the body then continues
the stream as it would in a plain run. Nothing seeded or drew in
between means the body would draw from an unseeded, per-process-random stream, and the ranks
keep cpq's fixed seed instead (reproducible). torch's generators are not carried: the ranks
seed torch's CPU and CUDA default generators with the task's fixed seed (pytest-randomly does
not touch torch either).

A shared leaf: imports nothing of cpq (the client and the rank both use it).
"""

from __future__ import annotations

import random
import sys
from typing import Any


def capture() -> dict[str, Any]:
    """The process's global states now, as msgpack-able data."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"random": [version, list(internal), gauss]}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = [str(name), keys.tobytes(), int(pos), int(has_gauss), float(cached)]
    return state


def install(state: dict[str, Any]) -> None:
    """Make ``state`` (from :func:`capture`) the process's global states."""
    if "random" in state:
        version, internal, gauss = state["random"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy

        name, keys, pos, has_gauss, cached = state["numpy"]
        array = numpy.frombuffer(keys, dtype=numpy.uint32).copy()
        numpy.random.set_state((name, array, pos, has_gauss, cached))


class Snapshot:
    """The states when the session began, to tell whether anything set them since.

    numpy is usually imported after cpq's plugin is configured (by the test modules, at
    collection): its state is first taken when it is first seen, which
    :meth:`observe` makes the end of collection (before any fixture could seed it).
    """

    def __init__(self) -> None:
        self._random = random.getstate()
        self._numpy = self._numpy_keys()

    @staticmethod
    def _numpy_keys() -> bytes | None:
        numpy = sys.modules.get("numpy")
        if numpy is None:
            return None
        state = numpy.random.get_state(legacy=True)
        return bytes(state[1].tobytes()) + repr(state[2:]).encode()

    def observe(self) -> None:
        """Take numpy's state now if it was not imported before."""
        if self._numpy is None:
            self._numpy = self._numpy_keys()

    def changed(self) -> bool:
        if random.getstate() != self._random:
            return True
        keys = self._numpy_keys()
        if self._numpy is None:
            self._numpy = keys
            return False
        return keys is not None and keys != self._numpy
