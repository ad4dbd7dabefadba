"""``cpq merge``'s judgement: every collected test ran exactly once, and how the shards did.

Why the check is strict: a fan-out that loses a test (a shard killed, a node lost) or runs
one twice (two shards that computed different partitions) still prints a green JUnit file
when each shard is looked at alone. The merge is the one place that sees every shard, so
it refuses to call a run complete unless all shards belong to one run (``run_id``: a
reused results directory may hold an earlier run's file for a shard that never wrote in
this one), agree on the collection and on the partition, every shard finished, and the
union of what ran is exactly what was collected.

Exit codes: 0 every test passed (or skipped), 1 a test failed, 2 the run is incomplete or
inconsistent (missing or duplicated tests, missing or unfinished shards, disagreeing
shards, results of more than one run), which wins over 1: a verdict on part of a suite is
not a verdict.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from cpq.fanout.manifest import Manifest
from cpq.fanout.shard import SPAWN_PREFIX

EXIT_PASSED, EXIT_FAILED, EXIT_INCOMPLETE = 0, 1, 2
#: How many ids a message lists before "and N more".
SHOW = 20


@dataclass
class MergeReport:
    manifests: list[Manifest]
    collected: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    duplicated: dict[str, list[str]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)
    run_id: str = ""
    #: Results of other runs left out because ``--run-id`` picked this one.
    ignored: list[str] = field(default_factory=list)

    #: Results of other runs, when no ``--run-id`` chose one (named as stale: exit 2).
    stale: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.problems or self.missing or self.duplicated:
            return EXIT_INCOMPLETE
        return EXIT_FAILED if self.failed else EXIT_PASSED

    @property
    def balance(self) -> float | None:
        walls = [m.wall_s for m in self.manifests if m.complete]
        if len(walls) < 2 or min(walls) <= 0:
            return None
        return max(walls) / min(walls)


def _listing(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:SHOW])
    return shown + (f" ... and {len(ids) - SHOW} more" if len(ids) > SHOW else "")


def _label(manifest: Manifest) -> str:
    return f"{manifest.index}/{manifest.count}"


def _agreement(manifests: Sequence[Manifest], report: MergeReport) -> None:
    """Problems when the shards disagree on the count, the collection or the partition."""
    counts = sorted({m.count for m in manifests})
    if len(counts) > 1:
        report.problems.append(f"shards disagree on the shard count: {counts}")
    by_collection: dict[str, list[Manifest]] = defaultdict(list)
    for manifest in manifests:
        by_collection[manifest.collection_hash].append(manifest)
    if len(by_collection) > 1:
        groups = "; ".join(
            f"{', '.join(_label(m) for m in group)} collected {len(group[0].collected)} tests "
            f"(hash {digest})"
            for digest, group in by_collection.items()
        )
        sets = [frozenset(group[0].collected) for group in by_collection.values()]
        differing = sorted(frozenset().union(*sets) - sets[0].intersection(*sets[1:]))
        report.problems.append(
            f"shards collected different suites: {groups}; differing tests: {_listing(differing)}"
        )
    by_partition: dict[str, list[str]] = defaultdict(list)
    inputs: dict[str, str] = {}
    for manifest in manifests:
        by_partition[manifest.partition_hash].append(_label(manifest))
        source = manifest.durations_from and f", durations of {manifest.durations_from}"
        inputs.setdefault(manifest.partition_hash, f"{source}, by {manifest.shard_by}")
    if len(by_partition) > 1 and len(by_collection) == 1:
        groups = "; ".join(f"{', '.join(v)} (hash {k}{inputs[k]})" for k, v in by_partition.items())
        report.problems.append(
            "shards computed different selections from the same collection (different "
            f"durations files or cpq versions?): {groups}"
        )
    seen: dict[int, list[Manifest]] = defaultdict(list)
    for manifest in manifests:
        seen[manifest.index].append(manifest)
    for index, group in sorted(seen.items()):
        if len(group) > 1:
            paths = ", ".join(m.path for m in group)
            report.problems.append(f"shard {index} has {len(group)} results: {paths}")
    for count in counts:
        absent = [i for i in range(count) if not any(m.count == count for m in seen.get(i, []))]
        if absent:
            report.problems.append(
                f"no result from shard(s) {', '.join(f'{i}/{count}' for i in absent)}"
            )
    for manifest in manifests:
        if not manifest.complete:
            report.problems.append(
                f"shard {_label(manifest)} on {manifest.hostname or '?'} did not finish "
                "(killed, cancelled or timed out before its session ended)"
            )


def _runs(manifests: Sequence[Manifest], report: MergeReport, run_id: str | None) -> None:
    """Keep the manifests of one run: ``run_id``'s, else the only one; with results of
    several runs and no choice, a problem naming the older runs' files as stale."""
    runs: dict[str, list[Manifest]] = defaultdict(list)
    for manifest in manifests:
        runs[manifest.run_id].append(manifest)
    if run_id is not None:
        report.run_id = run_id
        report.ignored = [m.path for m in manifests if m.run_id != run_id]
        report.manifests = runs.get(run_id, [])
        if not report.manifests:
            found = ", ".join(sorted(runs)) or "none"
            report.problems.append(f"no results of run {run_id} (runs found: {found})")
        return
    if len(runs) <= 1:
        report.run_id = next(iter(runs), "")
        return
    newest = max(runs, key=lambda r: max(m.started_at for m in runs[r]))
    report.run_id = newest
    report.manifests = runs[newest]  # the rows and counts are the newest run's only
    report.stale = [m.path for r, group in runs.items() if r != newest for m in group]
    stale = "; ".join(
        f"run {r}: {', '.join(m.path for m in group)}" for r, group in runs.items() if r != newest
    )
    report.problems.append(
        f"results of {len(runs)} runs: the newest is {newest}; stale files of other runs "
        f"({stale}): remove them or rerun those shards into run {newest} "
        "(or pick a run with --run-id)"
    )


def merge(manifests: Sequence[Manifest], run_id: str | None = None) -> MergeReport:
    """Check and combine shard manifests (already read and validated) of one run
    (``run_id``, else every manifest given, which must then be of one run)."""
    report = MergeReport(manifests=sorted(manifests, key=lambda m: (m.count, m.index, m.path)))
    _runs(report.manifests, report, run_id)
    ordered = report.manifests
    _agreement(ordered, report)
    collected: dict[str, None] = {}
    for manifest in ordered:
        collected.update(dict.fromkeys(manifest.collected))
    report.collected = list(collected)
    ran: dict[str, list[str]] = defaultdict(list)
    for manifest in ordered:
        for test_id, record in manifest.tests.items():
            ran[test_id].append(_label(manifest))
            if record.outcome in ("failed", "error"):
                report.failed.append(test_id)
        for test_id, seconds in manifest.durations().items():
            report.durations[test_id] = round(max(seconds, report.durations.get(test_id, 0)), 4)
    report.missing = [t for t in report.collected if t not in ran]
    report.duplicated = {t: shards for t, shards in ran.items() if len(shards) > 1}
    extra = [t for t in ran if t not in collected]
    if extra:
        report.problems.append(f"tests ran that no shard collected: {_listing(extra)}")
    spawn: dict[str, list[float]] = defaultdict(list)
    for manifest in ordered:
        for label, seconds in manifest.spawn_s.items():
            spawn[label].append(seconds)
    for label, values in spawn.items():
        report.durations[SPAWN_PREFIX + label] = round(statistics.median(values), 4)
    report.failed = list(dict.fromkeys(report.failed))
    _shard_statuses(ordered, report)
    return report


#: pytest's own exit statuses a finished shard may end with: passed, failed, no tests.
FINE_STATUSES = {0: "passed", 1: "failed", 5: "no tests"}


def _shard_statuses(manifests: Sequence[Manifest], report: MergeReport) -> None:
    """Fail closed on what only a shard's own exit status knows: the merged verdict is never
    better than a shard's. An interrupted, internally failed or misused pytest (2, 3, 4) is
    a problem (exit 2); a shard that failed (1) with none of its tests failed — a
    collection error under ``--continue-on-collection-errors``, a failing session fixture —
    makes the merge fail too, naming the shard."""
    for manifest in manifests:
        status = manifest.exitstatus
        if not manifest.complete or status is None:
            continue  # a shard still running or killed: its missing tests say so
        if status not in FINE_STATUSES:
            report.problems.append(
                f"shard {_label(manifest)} ended with pytest exit status {status} "
                "(interrupted, internal error or usage error): its verdict is not complete"
            )
        elif status == 1 and not any(
            r.outcome in ("failed", "error") for r in manifest.tests.values()
        ):
            report.failed.append(
                f"<shard {_label(manifest)}: pytest exit status 1 without a failed test "
                "(a collection error?)>"
            )


def _table(report: MergeReport) -> list[str]:
    """One row per shard, then one per earlier attempt of a shard (a requeue, a rerun)."""
    header = ("shard", "host", "tests", "failed", "wall s", "spawns", "wait s", "retries")
    rows = [(*header, "restarts", "")]
    for m in report.manifests:
        failed = sum(r.outcome in ("failed", "error") for r in m.tests.values())
        rows.append(
            (
                _label(m),
                m.hostname or "?",
                f"{len(m.tests)}/{len(m.selected)}",
                str(failed),
                f"{m.wall_s:.1f}",
                str(m.spawns),
                f"{m.spawn_wait_s:.1f}",
                str(m.retries),
                str(m.restart_count),
                "" if m.complete else "UNFINISHED",
            )
        )
        for n, a in enumerate(m.attempts):
            where = "finished, replaced" if a.complete else "lost"
            row = (f" attempt {n}", a.hostname or "?", str(a.tests), "", f"{a.wall_s:.1f}")
            rows.append((*row, str(a.spawns), "", "", str(a.restart_count), where))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    out = [line.rstrip() for line in out]
    if any(m.spawn_wait_s for m in report.manifests):
        out.append("  (wait s: time the shard's tests waited for groups to start, measured)")
    return out


def render(report: MergeReport, top: int = 10) -> str:
    """The summary ``cpq merge`` prints."""
    others = f" (and {len(report.stale)} of other runs)" if report.stale else ""
    lines = [
        f"cpq merge: {len(report.manifests)} shard result(s) of run {report.run_id or '?'}"
        f"{others}, {len(report.collected)} test(s) collected"
    ]
    if report.ignored:
        lines.append(f"ignored (other runs): {_listing(report.ignored)}")
    lines += _table(report)
    own = sorted(
        (
            (r.own_s, t, _label(m), r.spawn_wait_s or 0.0)
            for m in report.manifests
            for t, r in m.tests.items()
        ),
        key=lambda x: (-x[0], x[1]),
    )
    if own:
        lines.append(
            f"slowest {min(top, len(own))} test(s) (own time, without a wait for a group):"
        )
        lines += [
            f"  {w:8.2f}s  {t}  (shard {s}" + (f"; waited {q:.2f}s for a group)" if q else ")")
            for w, t, s, q in own[:top]
        ]
    balance = report.balance
    if balance is not None:
        complete = [m.wall_s for m in report.manifests if m.complete]
        lines.append(
            f"balance: max/min shard wall = {balance:.2f} "
            f"({max(complete):.1f}s / {min(complete):.1f}s)"
        )
    lines += [f"PROBLEM: {p}" for p in report.problems]
    if report.missing:
        lines.append(f"MISSING ({len(report.missing)}): {_listing(report.missing)}")
    if report.duplicated:
        dup = [f"{t} (shards {', '.join(s)})" for t, s in report.duplicated.items()]
        lines.append(f"DUPLICATED ({len(dup)}): {_listing(dup)}")
    if report.failed:
        lines.append(f"FAILED ({len(report.failed)}): {_listing(report.failed)}")
    verdict = {
        EXIT_PASSED: "every collected test ran exactly once and passed",
        EXIT_FAILED: f"every collected test ran exactly once; {len(report.failed)} failed",
        EXIT_INCOMPLETE: "INCOMPLETE: not every collected test ran exactly once",
    }[report.exit_code]
    lines.append(f"verdict: {verdict} (exit {report.exit_code})")
    return "\n".join(lines)
