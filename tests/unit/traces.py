"""A checker for Chrome's trace-event format (the JSON object form), as viewers read it.

Written from the format's documentation, not from cpq's builder: the fields every event of a
phase needs, complete slices that never overlap on one thread (a viewer draws overlapping
slices of one track wrongly or not at all), flow starts and ends that pair up and sit on
slices, counters with numeric values. Returns the slices per track for further checks.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

Track = tuple[int, int]


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_trace(trace: dict[str, Any]) -> dict[Track, list[dict[str, Any]]]:
    json.dumps(trace, allow_nan=False)  # plain JSON: no NaN or infinity anywhere
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    slices: dict[Track, list[dict[str, Any]]] = {}
    names: dict[Track, str] = {}
    flows: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for event in events:
        ph = event["ph"]
        assert isinstance(event["name"], str) and event["name"], event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int), event
        if ph == "M":
            assert event["name"] in {
                "process_name",
                "process_sort_index",
                "thread_name",
                "thread_sort_index",
            }, event
            assert len(event["args"]) == 1, event
            if event["name"] == "thread_name":
                names[(event["pid"], event["tid"])] = event["args"]["name"]
            continue
        assert _number(event["ts"]) and event["ts"] >= 0, event
        if ph == "X":
            assert _number(event["dur"]) and event["dur"] >= 0, event
            slices.setdefault((event["pid"], event["tid"]), []).append(event)
        elif ph == "C":
            assert event["args"] and all(_number(v) for v in event["args"].values()), event
        elif ph == "i":
            assert event.get("s", "t") in {"g", "p", "t"}, event
        elif ph in {"s", "f"}:
            key = (event["cat"], event["id"])
            assert ph not in flows.setdefault(key, {}), f"flow {key} has two {ph!r} events"
            flows[key][ph] = event
        else:
            raise AssertionError(f"unexpected phase {ph!r}: {event}")
    for track, track_slices in slices.items():
        assert track in names, f"track {track} has no thread_name"
        track_slices.sort(key=lambda e: e["ts"])
        for before, after in itertools.pairwise(track_slices):
            assert after["ts"] >= before["ts"] + before["dur"] - 1e-3, (
                f"slices overlap on {names[track]!r}: {before} / {after}"
            )
    for key, pair in flows.items():
        assert set(pair) == {"s", "f"}, f"flow {key} is not a start and an end: {pair}"
        for event in pair.values():
            on = slices.get((event["pid"], event["tid"]), [])
            assert any(s["ts"] <= event["ts"] <= s["ts"] + s["dur"] for s in on), (
                f"flow event outside any slice of its track: {event}"
            )
    return {track: s for track, s in slices.items()}


def thread_names(trace: dict[str, Any]) -> dict[Track, str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
