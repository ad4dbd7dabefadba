"""Coverage of what runs in the ranks, for a session that measures coverage (client side).

``pytest --cov`` (pytest-cov 6, 7), ``coverage run -m pytest``, with or without xdist: the
pytest process (or xdist worker) has a running :class:`coverage.Coverage`. For each task,
:func:`session_config` reads its configuration (source, include, omit, branch, the config
file it read) and the test's context (``--cov-context=test`` labels lines
``<nodeid>|run``, as pytest-cov does in the process); every rank measures the body with it
(:mod:`cpq.rank.coverage_task`) and sends its data back with its report; :func:`merge`
adds that data to the running measurement before the verdict is reported. The session then
saves, combines and reports as it always does: no data file of a rank is ever left for a
combine to find (a warm rank outlives sessions; a stray file would land in the wrong one).

Zero cost without coverage: :func:`current` is one ``sys.modules`` lookup when
:mod:`coverage` was never imported, and a task without a configuration runs nothing of
this on the ranks.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def current() -> Any:
    """The running ``coverage.Coverage`` of this process, None when nothing measures."""
    coverage = sys.modules.get("coverage")
    if coverage is None:
        return None
    cov = coverage.Coverage.current()
    if cov is None or not getattr(cov, "_started", False):
        return None
    return cov


def _absolute(entries: list[str] | None) -> list[str] | None:
    """Directories as absolute paths (a rank's working directory is not the caller's);
    package names stay names."""
    if not entries:
        return None
    return [os.path.abspath(e) if os.path.isdir(e) else e for e in entries]


def session_config(cov: Any, context: str) -> dict[str, Any]:
    """What a rank needs to measure the body as ``cov`` measures this process."""
    config = cov.config
    config_file = config.config_file
    return {
        "config_file": os.path.abspath(config_file) if config_file else "",
        "source": _absolute(config.source),
        "source_pkgs": list(config.source_pkgs or []) or None,
        "include": _absolute(config.run_include),
        "omit": _absolute(config.run_omit),
        "branch": bool(config.branch),
        "context": context,
    }


def merge(cov: Any, blobs: list[bytes]) -> None:
    """Add the ranks' data to ``cov``'s own (before the session saves and combines it)."""
    if not blobs:
        return
    from coverage import CoverageData

    data = _data_so_far(cov)
    for blob in blobs:
        ranks = CoverageData(no_disk=True)
        ranks.loads(blob)
        data.update(ranks)
    _seen_in_ranks(cov, data.measured_files())


#: Coverage's checks when it saves, which ``get_data`` also runs (private attributes, kept
#: since coverage 5): here they would warn in the middle of a session.
_SAVE_CHECKS = ("_warn_no_data", "_warn_unimported_source")


def _data_so_far(cov: Any) -> Any:
    """``cov``'s data so far, without the checks coverage makes when it saves: run by
    ``get_data`` in the middle of a session they warned "No data was collected" and "Module
    X was never imported" in the test that merged (a newcomer's trial: a package imported
    only in test bodies, which ran in the ranks), which a plain run never shows."""
    checks = {name: getattr(cov, name) for name in _SAVE_CHECKS if hasattr(cov, name)}
    for name in checks:
        setattr(cov, name, False)
    try:
        return cov.get_data()
    finally:
        for name, value in checks.items():
            setattr(cov, name, value)


def _seen_in_ranks(cov: Any, files: set[str]) -> None:
    """Take the ``--cov=package`` packages whose files the ranks measured off the ones
    coverage will say were never imported when it saves: this process never imported
    them (the test bodies that do ran in the ranks), a plain run's process did."""
    inorout = getattr(cov, "_inorout", None)
    unmatched = getattr(inorout, "source_pkgs_unmatched", None)
    if not unmatched or not files:
        return
    import importlib.util

    for name in list(unmatched):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin:
            continue
        where = os.path.dirname(spec.origin) if spec.submodule_search_locations else spec.origin
        if any(f == where or f.startswith(where + os.sep) for f in files):
            unmatched.remove(name)
