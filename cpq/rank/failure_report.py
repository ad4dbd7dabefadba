"""A failed test's report as pytest prints it, rendered in the rank that failed.

Only the rank has the frames: the ``>`` line where the test stopped, the ``E`` lines of
the (rewritten) assertion, the source around each entry. A fresh ``torchrun -m pytest``
prints exactly this per rank, so cpq renders it here, with pytest's own code, and the
client puts it into the report as it is (docs/design.md, "The pytest toolbox"). pytest's
default ``--tb=auto`` is what it follows: long entries for the first and the last frame,
short ones between; ``__tracebackhide__`` frames hidden. A rank that has not imported
pytest (a plain ``cpq submit`` task) renders nothing: its Python traceback stands.
"""

from __future__ import annotations

import io
import sys
from types import TracebackType


def render(exc: BaseException, tb: TracebackType | None) -> str:
    """pytest's long report of ``exc`` from frame ``tb`` on; "" without pytest loaded."""
    if tb is None or "_pytest" not in sys.modules:  # never import it here: a task that
        return ""  # did not import it pays nothing
    try:
        from _pytest._code import ExceptionInfo
        from _pytest._code.code import Traceback
        from _pytest._io import TerminalWriter

        info = ExceptionInfo.from_exc_info((type(exc), exc, tb))
        last = len(info.traceback) - 1
        info.traceback = Traceback(  # --tb=auto, as pytest's Node._repr_failure_py does it
            entry if i in (0, last) else entry.with_repr_style("short")
            for i, entry in enumerate(info.traceback)
        )
        text = info.getrepr(style="long", tbfilter=True, funcargs=True, chain=True)
        out = io.StringIO()
        text.toterminal(TerminalWriter(file=out))
        return out.getvalue().rstrip("\n")
    except Exception:  # a pytest whose internals differ (7.x): the Python traceback stands
        return ""
