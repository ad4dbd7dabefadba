"""A rank's pytest reports made fit to travel (msgpack, bounded): what
:mod:`cpq.rank.items` sends back of a test's protocol. Kept apart so the session's own
module stays about the session."""

from __future__ import annotations

from typing import Any

from cpq import protocol

#: Bound on each captured section a rank sends back (characters).
MAX_SECTION_CHARS = 256 * 1024
#: Plugin-made report attributes that cannot travel are dropped, these always stay.
REPORT_KEYS = ("nodeid", "location", "keywords", "outcome", "longrepr", "when", "sections")


def report(data: dict[str, Any]) -> dict[str, Any]:
    """A serialised report made msgpack-safe: sections bounded, plugin attributes that are
    not plain data dropped, user properties' values that are not plain data as ``repr``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "sections":
            value = [[title, bounded(str(text))] for title, text in value]
        elif key == "user_properties":
            value = [
                [str(name), v if not protocol.travel_problem(v) else repr(v)] for name, v in value
            ]
        if key in REPORT_KEYS or key == "user_properties" or not protocol.travel_problem(value):
            out[key] = value
    return out


def bounded(text: str) -> str:
    if len(text) <= MAX_SECTION_CHARS:
        return text
    cut = len(text) - MAX_SECTION_CHARS
    return text[:MAX_SECTION_CHARS] + f"\n[cpq: {cut} more characters cut]\n"
