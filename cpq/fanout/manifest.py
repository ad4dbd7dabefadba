"""A shard's manifest: what it was asked to run, what ran, and how it went.

Why a manifest beside the JUnit file: JUnit says what ran, not what should have. The
exactly-once check of ``cpq merge`` needs each shard's collected ids (to see a test no shard
kept), its selected ids (to see a shard that died part-way), two hashes (to see shards
that collected different suites, or computed different partitions from different durations
files) and the run it belongs to (``run_id``: a result left in a reused directory by an
earlier run must never stand in for a shard of this one). A shard clears its own earlier
files when it starts, writes its manifest when its share is known (``complete: false``),
again as tests finish (batched, see :class:`cpq.fanout.plugin.FanoutPlugin`), so a shard
killed mid-run names the tests it ran and those it still owed, and in full when its
session ends. Every write is atomic (a temporary file, then a rename).

File names hold the shard index and count (``shard-2-of-4.json``): a requeued or rerun
shard overwrites its own earlier result, and results of runs with another shard count do
not collide.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cpq.fanout.durations import write_json_atomic

FORMAT = "cpq-shard-manifest/2"
OUTCOMES = ("passed", "failed", "skipped", "error")


class ManifestError(ValueError):
    """A manifest file that cannot be read or does not have the expected shape."""


def stem(index: int, count: int) -> str:
    return f"shard-{index}-of-{count}"


@dataclass
class TestRecord:
    """One test's result in one shard: outcome, wall seconds (all phases), retries."""

    __test__ = False  # not a pytest test class

    outcome: str
    wall_s: float
    retries: int = 0
    message: str = ""  # one line: why it failed or was skipped
    details: str = ""  # the failure's long report (trimmed)
    #: Seconds its tasks waited for a group to start, as the broker measured them (None:
    #: no cpq task, or a broker that does not measure it).
    spawn_wait_s: float | None = None
    #: Whether ``wall_s`` includes that wait: a test run in the pytest process that waited
    #: for ``cpq.run`` does; one the ranks ran through pytest reports their own time only.
    wait_in_wall: bool = True
    #: What pytest's JUnit says of it (:mod:`cpq.fanout.junit`): the phase a failure or
    #: error happened in, and ``pytest.xfail`` or ``pytest.skip`` for a skipped test.
    when: str = ""
    kind: str = ""

    @property
    def own_s(self) -> float:
        """The test's own seconds: its wall without the wait for a group to start (that wait
        is the pool spec's spawn, reported apart: ``spawn_wait_s``, the shard's ``spawn_s``).
        What JUnit ``time``, the slowest-tests list and the next durations file say."""
        wait = (self.spawn_wait_s or 0.0) if self.wait_in_wall else 0.0
        return max(0.0, self.wall_s - wait)


@dataclass
class Attempt:
    """An earlier attempt at this shard in this run (a requeue, a rerun), whose result the
    current attempt replaced: what it ran, and where its timeline was kept
    (``shard-I-of-N.attempt-K.timeline.jsonl`` beside the manifest, "" when it left none),
    so that the merge's summary and timeline still show the time it took."""

    restart_count: int
    hostname: str
    started_at: float
    wall_s: float
    tests: int
    complete: bool
    spawns: int = 0
    timeline: str = ""


@dataclass
class Manifest:
    """The JSON result of one shard (see the module docstring)."""

    index: int
    count: int
    collection_hash: str
    partition_hash: str
    collected: list[str]
    selected: list[str]
    run_id: str = ""
    complete: bool = False
    source: str = ""
    hostname: str = ""
    restart_count: int = 0
    started_at: float = 0.0
    wall_s: float = 0.0
    exitstatus: int | None = None
    spawns: int = 0
    #: Per pool spec, the seconds this shard waited for its groups to start (measured).
    spawn_s: dict[str, float] = field(default_factory=dict)
    tests: dict[str, TestRecord] = field(default_factory=dict)
    #: Earlier attempts at this shard in this run, oldest first (see :class:`Attempt`).
    attempts: list[Attempt] = field(default_factory=list)
    #: The partition's input, fixed when the run started (a rerun of a shard of this run
    #: computes its share from it, whatever the durations file says by then): the seconds
    #: of the collected tests and the spawn costs it read (None: a manifest from before
    #: cpq recorded it), where they came from, and ``--cpq-shard-by``.
    run_durations: dict[str, float] | None = None
    durations_from: str = ""
    shard_by: str = "test"
    path: str = ""  # where it was read from (not written)

    def durations(self) -> dict[str, float]:
        """What this shard teaches the next partition: each test's own seconds
        (:attr:`TestRecord.own_s`; the wait for a group is the spec's spawn cost,
        ``spawn_s``, which the partition charges once per shard and not to the test that
        happened to wait)."""
        return {i: r.own_s for i, r in self.tests.items()}

    @property
    def spawn_wait_s(self) -> float:
        """Seconds this shard waited for groups to start (measured; see ``spawn_s``)."""
        return sum(self.spawn_s.values())

    def as_attempt(self, timeline: str) -> Attempt:
        """This result as an earlier attempt of a later one."""
        return Attempt(
            restart_count=self.restart_count,
            hostname=self.hostname,
            started_at=self.started_at,
            wall_s=self.wall_s,
            tests=len(self.tests),
            complete=self.complete,
            spawns=self.spawns,
            timeline=timeline,
        )

    @property
    def retries(self) -> int:
        return sum(r.retries for r in self.tests.values())

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("path")
        data["format"] = FORMAT
        return data

    def write(self, directory: Path) -> Path:
        path = directory / f"{stem(self.index, self.count)}.json"
        write_json_atomic(path, self.to_json())
        return path


def _need(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise ManifestError(f"{where}: missing {key!r}")
    value = data[key]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise ManifestError(f"{where}: {key!r} has {value!r}")
    return value


def _str_list(data: dict[str, Any], key: str, where: str) -> list[str]:
    value = _need(data, key, list, where)
    if not all(isinstance(v, str) for v in value):
        raise ManifestError(f"{where}: {key!r} must be a list of test ids")
    return list(value)


def _seconds_or_none(value: object, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ManifestError(f"{where} has {value!r}, not a number of seconds >= 0")
    return float(value)


def from_json(data: object, where: str) -> Manifest:
    """A :class:`Manifest` from parsed JSON; :class:`ManifestError` names what is wrong."""
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: not a cpq shard manifest (expected a JSON object)")
    if data.get("format") != FORMAT:
        raise ManifestError(f"{where}: not a cpq shard manifest (format {data.get('format')!r})")
    number = (int, float)
    tests: dict[str, TestRecord] = {}
    for test_id, raw in _need(data, "tests", dict, where).items():
        at = f"{where}: test {test_id!r}"
        if not isinstance(raw, dict):
            raise ManifestError(f"{at}: expected an object")
        outcome = _need(raw, "outcome", str, at)
        if outcome not in OUTCOMES:
            raise ManifestError(f"{at}: unknown outcome {outcome!r}")
        tests[test_id] = TestRecord(
            outcome=outcome,
            wall_s=float(_need(raw, "wall_s", number, at)),
            retries=int(raw.get("retries", 0)),
            message=str(raw.get("message", "")),
            details=str(raw.get("details", "")),
            spawn_wait_s=_seconds_or_none(raw.get("spawn_wait_s"), f"{at}: 'spawn_wait_s'"),
            wait_in_wall=raw.get("wait_in_wall", True) is not False,
            when=str(raw.get("when", "")),
            kind=str(raw.get("kind", "")),
        )
    index = _need(data, "index", int, where)
    count = _need(data, "count", int, where)
    if not 0 <= index < count:
        raise ManifestError(f"{where}: shard {index}/{count} is not a shard")
    spawn_s = _need(data, "spawn_s", dict, where)
    exitstatus = data.get("exitstatus")
    attempts = [
        _attempt(raw, f"{where}: attempt {n}") for n, raw in enumerate(data.get("attempts", []))
    ]
    return Manifest(
        index=index,
        count=count,
        collection_hash=_need(data, "collection_hash", str, where),
        partition_hash=_need(data, "partition_hash", str, where),
        collected=_str_list(data, "collected", where),
        selected=_str_list(data, "selected", where),
        run_id=_need(data, "run_id", str, where),
        complete=_need(data, "complete", bool, where),
        source=str(data.get("source", "")),
        hostname=str(data.get("hostname", "")),
        restart_count=int(data.get("restart_count", 0)),
        started_at=float(data.get("started_at", 0.0)),
        wall_s=float(_need(data, "wall_s", number, where)),
        exitstatus=exitstatus if isinstance(exitstatus, int) else None,
        spawns=int(_need(data, "spawns", int, where)),
        spawn_s={str(k): float(v) for k, v in spawn_s.items() if isinstance(v, number)},
        tests=tests,
        attempts=attempts,
        run_durations=_durations(data.get("run_durations"), where),
        durations_from=str(data.get("durations_from", "")),
        shard_by=str(data.get("shard_by", "test")),
        path=where,
    )


def _durations(raw: object, where: str) -> dict[str, float] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: 'run_durations' must be an object of seconds")
    return {
        str(k): float(_seconds_or_none(v, f"{where}: 'run_durations' {k!r}") or 0.0)
        for k, v in raw.items()
    }


def _attempt(raw: object, where: str) -> Attempt:
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: expected an object")
    number = (int, float)
    return Attempt(
        restart_count=int(_need(raw, "restart_count", int, where)),
        hostname=str(raw.get("hostname", "")),
        started_at=float(_need(raw, "started_at", number, where)),
        wall_s=float(_need(raw, "wall_s", number, where)),
        tests=int(_need(raw, "tests", int, where)),
        complete=bool(_need(raw, "complete", bool, where)),
        spawns=int(raw.get("spawns", 0)),
        timeline=str(raw.get("timeline", "")),
    )


def read(path: Path) -> Manifest:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}: not JSON ({exc})") from None
    return from_json(data, str(path))


def own_files(directory: Path, index: int, count: int) -> list[Path]:
    """Shard ``index`` of ``count``'s result files in ``directory`` (manifest, JUnit, the
    node's timeline for ``cpq merge --trace``, earlier attempts' timelines)."""
    suffixes = (".json", ".xml", ".timeline.jsonl")
    own = [directory / f"{stem(index, count)}{suffix}" for suffix in suffixes]
    return own + sorted(directory.glob(f"{stem(index, count)}.attempt-*.timeline.jsonl"))


def attempt_timeline(index: int, count: int, number: int) -> str:
    """The file name an earlier attempt's timeline is kept under, beside the manifest."""
    return f"{stem(index, count)}.attempt-{number}.timeline.jsonl"


def find(inputs: list[Path], empty_ok: bool = False) -> list[Path]:
    """Manifest files named by ``inputs``: files as given, directories' ``shard-*.json``
    (a directory with none is an error unless ``empty_ok``: the merge of a chosen run, whose
    shards may all have been cancelled before they wrote)."""
    found: list[Path] = []
    for path in inputs:
        if path.is_dir():
            matches = sorted(path.glob("shard-*-of-*.json"))
            if not matches and not empty_ok:
                raise ManifestError(f"{path}: no shard manifests (shard-I-of-N.json) in it")
            found += matches
        elif path.exists():
            found.append(path)
        else:
            raise ManifestError(f"{path}: no such file or directory")
    return list(dict.fromkeys(found))
