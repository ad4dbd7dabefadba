"""A shard's earlier attempts in its run, and the timeline a killed attempt leaves behind.

Why: a requeued shard (its node failed, it was cancelled and requeued) or a shard rerun into
the same run replaces its own result files, so the merge judges the attempt that finished.
The attempt that was lost still took time on a node: the merge's summary and its timeline
should show it, or the run's picture is missing the minutes that explain why it was slow.
So a shard that starts keeps what its run's earlier attempt left (its manifest, as an
:class:`~cpq.fanout.manifest.Attempt` in the new manifest, and its timeline file renamed to
``shard-I-of-N.attempt-K.timeline.jsonl``) before clearing the rest; files of another run
are cleared, never carried.

Rerunning a shard must reproduce the share it had when its run started, though the merge
has rewritten the durations file since: every manifest records the partition's input
(``run_durations``, ``shard_by``), and :func:`run_record` finds the one this run's shards
recorded, so the rerun computes the same partition from it.

A killed attempt never reaches the end of its session, where the timeline is exported
whole; :class:`TimelineTail` appends the node's new records to the shard's timeline file
each time the manifest is rewritten, so a killed attempt leaves its timeline up to its last
finished test.
"""

from __future__ import annotations

import json
from pathlib import Path

from cpq.fanout.manifest import (
    Attempt,
    Manifest,
    ManifestError,
    attempt_timeline,
    own_files,
    read,
    stem,
)


def timeline_file(results: Path, index: int, count: int) -> Path:
    return results / f"{stem(index, count)}.timeline.jsonl"


def carry_over(results: Path, index: int, count: int, run_id: str) -> list[Attempt]:
    """Clear shard ``index``/``count``'s earlier files in ``results``, keeping what an earlier
    attempt of run ``run_id`` left: its attempts (oldest first), its timeline renamed."""
    files = own_files(results, index, count)
    try:
        previous = read(files[0])
    except ManifestError:
        previous = None  # none, or unreadable: nothing of it is this run's to keep
    kept: list[Attempt] = []
    if previous is not None and previous.run_id == run_id:
        kept = list(previous.attempts)
        current = timeline_file(results, index, count)
        name = attempt_timeline(index, count, len(kept))
        if current.exists():
            current.replace(results / name)
        else:
            name = ""
        kept.append(previous.as_attempt(name))
    keep = {a.timeline for a in kept if a.timeline}
    for path in files:
        if path.name not in keep:
            path.unlink(missing_ok=True)
    return kept


def run_record(results: Path, index: int, count: int, run_id: str) -> Manifest | None:
    """A manifest of run ``run_id`` with ``count`` shards in ``results`` that recorded the
    partition's input (shard ``index``'s own first, then the others'); None when there is
    none (the run's first attempt at every shard, or results from before cpq recorded it)."""
    own = results / f"{stem(index, count)}.json"
    others = sorted(p for p in results.glob(f"shard-*-of-{count}.json") if p != own)
    for path in [own, *others]:
        try:
            found = read(path)
        except ManifestError:
            continue
        if found.run_id == run_id and found.count == count and found.run_durations is not None:
            return found
    return None


class TimelineTail:
    """Appends the node's timeline records from ``since`` on to ``out`` as they arrive.

    Reads only what was added to ``source`` since the last call (the broker appends whole
    lines, once per tick), so a rewrite of the manifest stays cheap however long the
    history. A record whose line is torn is left for the next call.
    """

    def __init__(self, source: Path, out: Path, since: float) -> None:
        self.source = source
        self.out = out
        self.since = since
        self.offset = 0

    def flush(self) -> int:
        """Append what is new; how many records were appended."""
        try:
            with self.source.open("rb") as handle:
                size = handle.seek(0, 2)
                if size < self.offset:
                    self.offset = 0  # the history was replaced: read it again
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return 0
        end = data.rfind(b"\n") + 1
        self.offset += end
        kept = [line for line in data[:end].splitlines(keepends=True) if self._new(line)]
        if kept:
            with self.out.open("ab") as handle:
                handle.write(b"".join(kept))
        return len(kept)

    def _new(self, line: bytes) -> bool:
        try:
            record = json.loads(line)
        except ValueError:
            return False
        stamp = record.get("t") if isinstance(record, dict) else None
        return isinstance(stamp, int | float) and stamp >= self.since
