"""The warning filters an import added, and adding them again where it is handed over
(docs/design.md, "Imports ahead of a session"): as the import's own ``filterwarnings`` calls
would add them now, in front of or behind the session's own."""

from __future__ import annotations

import warnings
from typing import Any


def delta(old: list[Any], new: list[Any]) -> tuple[list[Any], list[Any]] | None:
    """``(put in front, appended)`` such that ``warnings.filterwarnings`` calls adding them
    turn ``old`` into ``new`` (a filter added again moves to the front, as ``warnings``
    does); None when no such calls do (a filter removed, the list reset)."""
    for k in range(len(new) + 1):
        front = new[:k]
        kept = [f for f in old if f not in front]
        rest = new[k:]
        if rest[: len(kept)] == kept and all(f not in old for f in rest[len(kept) :]):
            return front, rest[len(kept) :]
    return None


def replay(front: list[Any], back: list[Any]) -> None:
    """Add the filters a part's imports added, as their ``filterwarnings`` calls would now."""
    filters = list(warnings.filters)
    for item in reversed(front):
        if item in filters:
            filters.remove(item)
        filters.insert(0, item)
    filters += [item for item in back if item not in filters]
    put(filters)


def put(filters: list[Any]) -> None:
    """Make ``warnings.filters`` ``filters`` (and tell ``warnings`` they changed)."""
    if warnings.filters != filters:
        warnings.filters[:] = filters  # type: ignore[index]
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is not None:
            mutated()
