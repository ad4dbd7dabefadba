"""Measure a task's body with the session's coverage configuration (rank side).

A pytest session that measures coverage (pytest-cov, ``coverage run -m pytest``) sends its
configuration with each task (:mod:`cpq.client.coverage_relay` builds it). Each rank measures the
body with an in-memory :class:`coverage.Coverage` of that configuration and sends the data
back with its report (``RankDone.coverage``); the pytest process merges it into its own
running measurement, so the session's combine and report include what ran in the ranks.
Nothing is written to disk here: a rank outlives sessions, and a data file left behind would
be combined into the wrong one.

One ``Coverage`` object is kept per configuration (building one reads the config file, and
its first start builds the collector); only its data is read and erased after each task.
Nothing of this runs for a task without coverage: :mod:`coverage` is imported by the first
measured task.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_covers: dict[tuple[Any, ...], Any] = {}
#: cpq's own package: not the user's code (measured only when a source names it).
_CPQ_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _coverage_for(config: dict[str, Any]) -> Any:
    key = tuple(sorted((k, repr(v)) for k, v in config.items() if k != "context"))
    cov = _covers.get(key)
    if cov is None:
        import coverage

        source = config.get("source") or None
        source_pkgs = config.get("source_pkgs") or None
        omit = list(config.get("omit") or [])
        if source is None and source_pkgs is None and not config.get("include"):
            omit.append(os.path.join(_CPQ_DIR, "*"))
        cov = coverage.Coverage(
            data_file=None,  # in memory: the data travels back on the wire
            config_file=config.get("config_file") or False,
            source=source,
            source_pkgs=source_pkgs,
            include=config.get("include") or None,
            omit=omit or None,
            branch=bool(config.get("branch")),
        )
        _covers[key] = cov
    return cov


def _skip_unexecuted_search(cov: Any) -> None:
    """Reading the data (``get_data``) also walks every source directory for files that
    never ran, to list them at 0 %: per task that costs a walk of the user's tree (16 ms
    for 600 files), and the session's own save lists them anyway. coverage 7 has no switch
    for it, so the walk is replaced on this rank's object (where the attribute exists)."""
    inorout = getattr(cov, "_inorout", None)
    if inorout is not None and hasattr(inorout, "find_possibly_unexecuted_files"):
        inorout.find_possibly_unexecuted_files = lambda: iter(())


@contextmanager
def measured(config: dict[str, Any] | None, out: list[bytes]) -> Iterator[None]:
    """Measure what runs inside when ``config`` is given; append the data to ``out``."""
    if config is None:
        yield
        return
    cov = _coverage_for(config)
    cov.start()
    _skip_unexecuted_search(cov)
    if config.get("context"):
        cov.switch_context(config["context"])
    try:
        yield
    finally:
        cov.stop()
        data = cov.get_data()
        out.append(data.dumps())
        # The data only: Coverage.erase() would rebuild the collector at the next start
        # (~30 ms in a rank that imported torch: it walks the stack and sys.modules).
        data.erase()
