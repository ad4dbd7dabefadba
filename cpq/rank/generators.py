"""The random generators of a calling session's tests in a rank (cpq.rank.items).

A session's first test here starts ``random``, numpy's legacy generator and torch's (CPU,
CUDA) from fresh entropy, as a fresh process does; its later tests go on from where the
last one left them. Only when another kind of task (a ``cpq.run`` function, a launch) is
about to reseed them are they read out (:func:`states`, a CUDA copy) and put back before
the session's next test (:func:`restore`).
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any


def states() -> dict[str, Any]:
    """The states of ``random``, numpy's legacy generator and torch's (CPU, CUDA) now."""
    states: dict[str, Any] = {"random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state(legacy=True)
    torch = sys.modules.get("torch")
    if torch is not None:
        states["torch"] = torch.get_rng_state()
        if torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore(saved: dict[str, Any]) -> None:
    random.setstate(saved["random"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if "numpy" in saved:
            numpy.random.set_state(saved["numpy"])
        else:  # imported by the last test: where a fresh process's would be, near enough
            numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in saved:
        torch.set_rng_state(saved["torch"])
        if "cuda" in saved and torch.cuda.is_initialized():
            torch.cuda.set_rng_state_all(saved["cuda"])


def start_fresh() -> None:
    """``random``, numpy and torch as a fresh process starts them: from fresh entropy."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # its legacy seed(None) costs 160 us; 32 fresh bits, 4 us
        numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(int.from_bytes(os.urandom(8), "little") >> 1)
