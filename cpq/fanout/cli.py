"""``cpq merge [--junit OUT.xml] [--durations OUT.json] [--run-id ID] DIR_OR_FILE...``.

Kept apart from ``cpq.client.cli`` so the merge (a CI step on a machine that may have no broker,
no GPU and no torch) imports nothing but the standard library and this package.
Bad input (an unreadable or malformed manifest, a durations file that is not an object of
seconds) is exit 4 like every other cpq usage error, and is detected before anything is
written, so a failed merge never replaces a good durations file. An incomplete run (exit 2)
writes nothing either: its durations would teach the next partition from part of a suite,
and a merged JUnit file of part of a suite reads as a green run to a CI that shows it.
An error of the merge itself (a bug, not the input) is exit 3, so that no CI reads it as
"a test failed" (1).

What the merge writes belongs to the run it judged: it removes the trace and timeline files
it was asked to write, and a JUnit file of another run (the file names its run), so a merge
that writes none (exit 2, 3, 4) leaves no file of an earlier run where a CI step would
publish it as this run's. A JUnit file of the same run (an earlier merge, before a shard was
rerun) is replaced only by a complete merge's: a rerun cancelled midway leaves the run's
last verdict in place. The durations file is not a run's: it is what every run so far
taught the partition, updated, never removed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

from cpq.fanout import durations, junit, manifest
from cpq.fanout.merge import EXIT_INCOMPLETE, merge, render

EXIT_USAGE = 4
EXIT_INTERNAL = 3


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs",
        nargs="+",
        type=Path,
        metavar="DIR_OR_FILE",
        help="shard result directories (their shard-I-of-N.json) or manifest files",
    )
    parser.add_argument("--junit", type=Path, help="write one merged JUnit XML file here")
    parser.add_argument(
        "--durations",
        type=Path,
        help="update this durations file (test id -> seconds) with the merged run's walls",
    )
    parser.add_argument("--top", type=int, default=10, help="how many slowest tests to list")
    parser.add_argument(
        "--run-id",
        default=None,
        help="merge only this run's results (CPQ_RUN_ID of the shards); results of other "
        "runs are listed and ignored, and a run none of whose shards wrote is exit 2. "
        "Without it, results of several runs are exit 2",
    )
    from cpq.timeline.command import add_output_arguments

    add_output_arguments(parser)  # --trace/--timeline: every shard's groups on one axis


def junit_run(path: Path) -> str | None:
    """The run a merged JUnit file names (``<testsuites name="cpq run ID">``), else None."""
    try:
        name = ET.parse(path).getroot().get("name") or ""
    except (OSError, ET.ParseError):
        return None
    return name.removeprefix("cpq run ") if name.startswith("cpq run ") else None


def clear_outputs(args: argparse.Namespace, run_id: str | None) -> None:
    """Remove the per-run files this merge was asked for, but a JUnit file of ``run_id``
    (None: the run is not known, every file goes; see the module docstring)."""
    for path in (args.junit, args.trace, args.timeline):
        if path is None or not path.is_file():
            continue
        if path == args.junit and run_id is not None and junit_run(path) == run_id:
            print(f"kept {path} (run {run_id}'s earlier merge) until a complete merge replaces it")
            continue
        path.unlink()
        print(f"removed {path} (an earlier merge's): this merge writes its own or none")


def run_merge(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        found = manifest.find(args.inputs, empty_ok=args.run_id is not None)
        manifests = [manifest.read(p) for p in found]
        if args.durations is not None:
            durations.load(args.durations)  # refuse a malformed one before writing anything
    except (manifest.ManifestError, durations.DurationsError) as exc:
        clear_outputs(args, args.run_id)
        print(f"cpq merge: {exc}", file=sys.stderr)
        return EXIT_USAGE
    report = merge(manifests, run_id=args.run_id)
    clear_outputs(args, report.run_id or None)
    print(render(report, top=args.top))
    if report.exit_code == EXIT_INCOMPLETE:
        print("nothing written: the run is incomplete (exit 2)")
        return EXIT_INCOMPLETE
    if args.trace or args.timeline:
        from cpq.timeline.command import merge_pictures

        if merge_pictures(pictured(report.manifests), args.trace, args.timeline):
            return EXIT_USAGE
    try:
        if args.junit is not None:
            junit.write(args.junit, report.manifests)
            print(f"junit: {args.junit}")
        if args.durations is not None:
            written = durations.update(args.durations, report.durations)
            print(f"durations: {args.durations} ({len(written)} entries)")
    except (OSError, durations.DurationsError) as exc:
        print(f"cpq merge: cannot write: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"merged in {time.monotonic() - started:.3f}s")
    return report.exit_code


def pictured(manifests: list[manifest.Manifest]) -> list[tuple[Path, str]]:
    """What the merged timeline draws: each shard, and before it each earlier attempt of it
    that left a timeline (a requeued shard's lost attempt took time on a node too). Given
    as the manifest path the timeline file lies beside (``cpq.timeline.command.shard_file``)."""
    shards: list[tuple[Path, str]] = []
    for m in manifests:
        path = Path(m.path)
        for n, attempt in enumerate(m.attempts):
            if attempt.timeline:
                fate = "finished, replaced" if attempt.complete else "lost"
                label = f"shard {m.index}/{m.count} {attempt.hostname} attempt {n} ({fate})"
                beside = path.with_name(attempt.timeline.removesuffix(".timeline.jsonl") + ".json")
                shards.append((beside, label))
            else:
                print(f"shard {m.index}/{m.count}'s attempt {n} left no timeline")
        shards.append((path, f"shard {m.index}/{m.count} {m.hostname}"))
    return shards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpq merge", description=__doc__.splitlines()[0])
    add_merge_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    return guarded(args)


def guarded(args: argparse.Namespace) -> int:
    """:func:`run_merge`, with an unexpected exception as exit 3 and its traceback shown."""
    try:
        return run_merge(args)
    except Exception:
        traceback.print_exc()
        with contextlib.suppress(OSError):
            clear_outputs(args, args.run_id)
        print("cpq merge: internal error (exit 3): no verdict", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
