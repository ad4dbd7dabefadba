"""``cpq-status --trace PATH`` / ``--timeline PATH.html`` and ``cpq merge --trace/--timeline``.

Kept here, not in the command-line modules, so that each of them adds a few lines of
argument wiring: the status command and the fan-out merge share the window options and the
writing. Nothing here needs a broker: the pictures are made from the history files, like
``cpq-status --timings``. Bad input (an unknown session, an unreadable time, an empty
window) is a clear error and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path

from cpq.timeline import records
from cpq.timeline.html import build_html
from cpq.timeline.run import Run, WindowError, build, last_session, session_span, window
from cpq.timeline.trace import build_trace

#: Bad input, as every cpq command says it.
EXIT_USAGE = 4
TITLE = "cpq timeline"
_AGO = re.compile(r"^-(\d+(?:\.\d+)?)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="PATH",
        help="write a Chrome trace-event JSON of the groups and tasks (open it in "
        "https://ui.perfetto.dev)",
    )
    parser.add_argument(
        "--timeline",
        type=Path,
        metavar="PATH.html",
        help="write one self-contained HTML page: the timeline and where the time went",
    )


def add_window_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--session",
        default="last",
        help="--trace/--timeline: the pytest session to show ('last', the default; 'all': "
        "the whole history; or a session id)",
    )
    parser.add_argument(
        "--since", help="--trace/--timeline: from this time (epoch seconds, ISO 8601, or -30m)"
    )
    parser.add_argument("--until", help="--trace/--timeline: until this time (same forms)")


def parse_time(text: str | None, now: float) -> float | None:
    """Epoch seconds, an ISO 8601 time (local time unless it says), or ``-<n>[smhd]``."""
    if text is None:
        return None
    ago = _AGO.match(text.strip())
    if ago:
        return now - float(ago.group(1)) * _UNIT[ago.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise WindowError(
            f"cannot read the time {text!r} (epoch seconds, ISO 8601, or -30m)"
        ) from None


def select(run: Run, session: str, since: float | None, until: float | None) -> Run:
    """The window of ``run``: the session's span (``last``: the most recent session's; when
    no task names a session and no range is given, everything), within ``since``/``until``."""
    start, end = since, until
    if session != "all":
        has_sessions = any(a.session for a in run.attempts)
        if session != "last" or has_sessions:
            lo, hi = session_span(run, last_session(run) if session == "last" else session)
            start = lo if start is None else max(start, lo)
            end = hi if end is None else min(end, hi)
    return window(run, start, end)


def load(path: Path, source: str = "") -> Run:
    loaded = records.read(path)
    return build(loaded.records, source, loaded.skipped)


def write(runs: list[Run], trace: Path | None, timeline: Path | None, title: str) -> list[str]:
    """Write the asked-for files (each atomically); the lines to print about them."""
    said: list[str] = []
    if not any(r.attempts or r.groups for r in runs):
        raise WindowError("nothing to draw: no group and no task in the window")
    if trace is not None:
        _write_atomic(trace, json.dumps(build_trace(runs)))
        said.append(f"trace: {trace} (open it in https://ui.perfetto.dev)")
    if timeline is not None:
        _write_atomic(timeline, build_html(runs, title))
        said.append(f"timeline: {timeline}")
    skipped = sum(r.skipped for r in runs)
    if skipped:
        said.append(f"skipped {skipped} unreadable line(s) of the history")
    return said


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def status_pictures(args: argparse.Namespace, timings_path: Path) -> int:
    """``cpq-status --trace/--timeline``: from the history beside ``timings_path``."""
    path = records.timeline_path(timings_path)
    try:
        run = load(path)
        if not run.attempts and not run.groups:
            raise WindowError(f"no timeline history in {path}")
        now = time.time()
        since, until = parse_time(args.since, now), parse_time(args.until, now)
        said = write([select(run, args.session, since, until)], args.trace, args.timeline, TITLE)
    except (WindowError, OSError) as exc:
        print(f"cpq-status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in said:
        print(line)
    return 0


# --------------------------------------------------------------------------- fan-out shards


def shard_file(manifest_path: Path) -> Path:
    """Where a shard's timeline lies: beside its manifest, ``shard-I-of-N.timeline.jsonl``."""
    return manifest_path.with_name(f"{manifest_path.stem}.timeline.jsonl")


def export_shard(out: Path, timings_path: Path, since: float, tests: int, wait_s: float) -> int:
    """Copy this node's timeline records from ``since`` on into ``out`` (a shard's result
    directory), for ``cpq merge --trace/--timeline``; returns how many were copied.

    The broker writes its events once per tick: the export waits (at most ``wait_s``) until
    the records of the session's ``tests`` task verdicts are on disk, polling the file.
    """
    source = records.timeline_path(timings_path)
    deadline = time.monotonic() + wait_s
    while True:
        kept = [r for r in records.read(source).records if r["t"] >= since]
        done = sum(1 for r in kept if r["ev"] == "task" and not r["outcome"].startswith("retr"))
        if done >= tests or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if kept:
        _write_atomic(out, "".join(records.iter_lines(kept)))
    return len(kept)


def merge_pictures(manifests: list[tuple[Path, str]], trace: Path | None, html: Path | None) -> int:
    """``cpq merge --trace/--timeline``: each shard's exported timeline, one track group per
    shard, on one time axis. A shard without its timeline is an error (nothing written)."""
    try:
        runs = []
        for path, label in manifests:
            source = shard_file(path)
            if not source.exists():
                raise WindowError(f"{label} has no timeline ({source} is missing)")
            runs.append(load(source, label))
        said = write(runs, trace, html, "cpq fan-out timeline")
    except (WindowError, OSError) as exc:
        print(f"cpq merge: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in said:
        print(line)
    return 0
