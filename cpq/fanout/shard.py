"""Which shard this process is, and which tests each shard keeps (a pure function).

Why a pure function of (collected tests, durations, shard count): every shard of a CI
fan-out runs on its own node with no coordinator, so the only way for N processes to agree
on a partition with no test lost or run twice is for each to compute the same one from the
same input. Nothing here reads a clock, the environment (except :func:`shard_from_env`,
which is given the mapping), or a random source; ties are broken by test id.

Shard indices are **0-based** everywhere (``--cpq-shard 0/4`` .. ``3/4``), as Slurm array
task ids (``--array=0-3``) and Kubernetes' ``JOB_COMPLETION_INDEX`` are by default. A Slurm
array that starts elsewhere (``--array=1-4``) is shifted by ``SLURM_ARRAY_TASK_MIN``; an
array with gaps or a step cannot map onto 0..N-1 and is refused.

Balancing is longest-processing-time first, greedy onto the least-loaded shard. A test's
expected seconds are its recorded duration, else the median of the known ones (1 s when
none is known). A marker test also needs a warm group of its pool spec: a shard that gets
tests of spec S pays S's spawn cost once (recorded in the durations file under
``cpq:spawn:<label>``, else :data:`DEFAULT_SPAWN_S`). Placing test by test would spread a
spec over every shard (each paying a spawn) before seeing that keeping it together is
cheaper, so a spec's tests are first cut into as many chunks as it pays to spawn it on,
and chunks are placed longest first (see :func:`partition`).
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Spawn cost of a pool spec when the durations file has none: starting torch in every rank
#: and a gloo process group takes ~5 s on a small CPU machine (BENCHMARKS.md).
DEFAULT_SPAWN_S = 5.0
#: Expected seconds of a test when no test's duration is known at all.
DEFAULT_TEST_S = 1.0
#: Key prefix, in the durations file, of a pool spec's spawn seconds.
SPAWN_PREFIX = "cpq:spawn:"

_SHARD_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


class ShardError(ValueError):
    """A shard given on the command line or in the environment makes no sense."""


@dataclass(frozen=True)
class ShardSpec:
    """Shard ``index`` (0-based) of ``count``, and where that was read from."""

    index: int
    count: int
    source: str = "--cpq-shard"

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ShardError(f"{self.source}: shard count must be at least 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ShardError(
                f"{self.source}: shard index {self.index} is not in 0..{self.count - 1} "
                f"(indices are 0-based: --cpq-shard 0/{self.count} .. "
                f"{self.count - 1}/{self.count})"
            )

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class TestInfo:
    """A collected test as the partition sees it: its id and the pool spec it needs."""

    __test__ = False  # not a pytest test class

    test_id: str
    spec: str | None = None  # pool spec label of a marker test; None for an unmarked test
    #: The unit it must share a shard with (its module or class under ``--cpq-shard-by``);
    #: "" keeps it alone (the default, ``test``).
    group: str = ""


def parse_shard(text: str, source: str = "--cpq-shard") -> ShardSpec:
    """``"I/N"`` (0-based I) as a :class:`ShardSpec`; a clear :class:`ShardError` otherwise."""
    match = _SHARD_RE.match(text)
    if not match:
        raise ShardError(f"{source}: expected I/N with 0 <= I < N (e.g. 0/4), got {text!r}")
    return ShardSpec(int(match.group(1)), int(match.group(2)), source)


def _int_var(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ShardError(f"{name}={raw!r} is not an integer") from None


def shard_from_env(env: Mapping[str, str]) -> ShardSpec | None:
    """The shard the environment names, strongest first: ``CPQ_SHARD``, a Slurm array task,
    a Kubernetes Indexed Job pod with ``CPQ_SHARD_COUNT``; ``None`` when none does."""
    if env.get("CPQ_SHARD"):
        return parse_shard(env["CPQ_SHARD"], "CPQ_SHARD")
    if env.get("SLURM_ARRAY_TASK_ID") and env.get("SLURM_ARRAY_TASK_COUNT"):
        task = _int_var(env, "SLURM_ARRAY_TASK_ID")
        count = _int_var(env, "SLURM_ARRAY_TASK_COUNT")
        first = _int_var(env, "SLURM_ARRAY_TASK_MIN") if env.get("SLURM_ARRAY_TASK_MIN") else 0
        if env.get("SLURM_ARRAY_TASK_MAX"):
            last = _int_var(env, "SLURM_ARRAY_TASK_MAX")
            if last - first + 1 != count:
                raise ShardError(
                    f"Slurm array {first}-{last} has {count} tasks: use a contiguous array "
                    "without a step (--array=0-N-1) so that tasks map onto shards 0..N-1"
                )
        return ShardSpec(task - first, count, "SLURM_ARRAY_TASK_ID")
    if env.get("JOB_COMPLETION_INDEX"):
        if not env.get("CPQ_SHARD_COUNT"):
            raise ShardError(
                "JOB_COMPLETION_INDEX is set but CPQ_SHARD_COUNT is not: set it to the Job's "
                "completions (the number of shards)"
            )
        return ShardSpec(
            _int_var(env, "JOB_COMPLETION_INDEX"),
            _int_var(env, "CPQ_SHARD_COUNT"),
            "JOB_COMPLETION_INDEX",
        )
    return None


def spec_label(world_size: int, env: Mapping[str, str] | None = None) -> str:
    """A pool spec's name in durations files: ``ws2``, ``ws2 NVTE_FLASH_ATTN=0``."""
    extra = "".join(f" {k}={v}" for k, v in sorted((env or {}).items()))
    return f"ws{world_size}{extra}"


def expected_seconds(tests: Sequence[TestInfo], durations: Mapping[str, float]) -> dict[str, float]:
    """Each test's expected seconds: recorded, else the median of the recorded ones."""
    known = [durations[t.test_id] for t in tests if t.test_id in durations]
    fallback = statistics.median(known) if known else DEFAULT_TEST_S
    return {t.test_id: float(durations.get(t.test_id, fallback)) for t in tests}


def spawn_seconds(label: str, durations: Mapping[str, float]) -> float:
    return float(durations.get(SPAWN_PREFIX + label, DEFAULT_SPAWN_S))


def _split_counts(
    groups: Mapping[str, list[tuple[float, str]]],
    work: float,
    durations: Mapping[str, float],
    count: int,
) -> dict[str, int]:
    """Over how many shards each spec's units spread (each chunk pays the spawn once).

    Spreading a spec over k shards shortens its longest chunk to about (T - s) / k + s but
    adds (k - 1) spawns to the total work; k is the one that minimises the larger of the two
    bounds on the makespan, with every other spec's spawn counted once. ``groups`` holds
    each spec's units as (seconds, id); ``work`` is every test's seconds.
    """
    spawns = {label: spawn_seconds(label, durations) for label in groups}
    total = work + sum(spawns.values())
    counts: dict[str, int] = {}
    for label, units in groups.items():
        s = spawns[label]
        own = sum(seconds for seconds, _ in units)
        limit = min(count, len(units))
        counts[label] = min(
            range(1, limit + 1),
            key=lambda k: (max(own / k + s, (total + (k - 1) * s) / count), k),
        )
    return counts


def _lpt(items: Sequence[tuple[float, str]], bins: int) -> list[list[str]]:
    """Longest first onto the least-loaded bin (ties: lower bin), ids within each bin."""
    loads = [0.0] * bins
    out: list[list[str]] = [[] for _ in range(bins)]
    for seconds, test_id in sorted(items, key=lambda x: (-x[0], x[1])):
        best = min(range(bins), key=lambda b: (loads[b], b))
        loads[best] += seconds
        out[best].append(test_id)
    return out


@dataclass(frozen=True)
class _Unit:
    """Tests that go to one shard together: one test (``--cpq-shard-by test``), or a module's
    or class's tests; ``key`` (its least test id) orders equal costs."""

    key: str
    ids: tuple[str, ...]
    seconds: float
    specs: frozenset[str]


def _units(unique: Sequence[TestInfo], cost: Mapping[str, float]) -> list[_Unit]:
    members: dict[tuple[bool, str], list[TestInfo]] = {}
    for test in unique:
        key = (True, test.group) if test.group else (False, test.test_id)
        members.setdefault(key, []).append(test)
    return [
        _Unit(
            key=min(t.test_id for t in tests),
            ids=tuple(t.test_id for t in tests),
            seconds=sum(cost[t.test_id] for t in tests),
            specs=frozenset(t.spec for t in tests if t.spec is not None),
        )
        for tests in members.values()
    ]


def partition(
    tests: Sequence[TestInfo], count: int, durations: Mapping[str, float]
) -> list[list[str]]:
    """The test ids of each of ``count`` shards, each list in collection order.

    Tests of one :attr:`TestInfo.group` (a module or a class under ``--cpq-shard-by``) form
    one unit that lands on one shard; every other test is a unit of its own. Units whose
    tests need one pool spec are first split into as many chunks as it pays to spawn that
    spec on (:func:`_split_counts`, balanced longest first); each chunk costs its tests
    plus one spawn; a unit of unmarked tests, or of tests of several specs, is a chunk of
    its own. Chunks then go longest first onto the shard whose load after placing them is
    smallest (a shard that already has a spec pays no second spawn for it); ties go to the
    lower shard index, chunks of equal cost in test id order. Duplicate ids (which pytest
    never produces) keep their first occurrence.
    """
    if count < 1:
        raise ShardError(f"shard count must be at least 1, got {count}")
    unique = list({t.test_id: t for t in reversed(tests)}.values())[::-1]
    cost = expected_seconds(unique, durations)
    units = _units(unique, cost)
    by_key = {u.key: u for u in units}
    groups: dict[str, list[tuple[float, str]]] = {}
    for unit in units:
        if len(unit.specs) == 1:
            groups.setdefault(next(iter(unit.specs)), []).append((unit.seconds, unit.key))
    chunks: list[tuple[float, str, frozenset[str], list[str]]] = []  # seconds, key, specs, ids
    for spec, k in sorted(_split_counts(groups, sum(cost.values()), durations, count).items()):
        for keys in _lpt(groups[spec], k):
            if keys:
                ids = [i for key in keys for i in by_key[key].ids]
                seconds = sum(by_key[key].seconds for key in keys)
                chunks.append((seconds, min(keys), frozenset({spec}), ids))
    chunks += [(u.seconds, u.key, u.specs, list(u.ids)) for u in units if len(u.specs) != 1]

    def spawns(labels: frozenset[str]) -> float:
        return sum(spawn_seconds(label, durations) for label in sorted(labels))

    loads = [0.0] * count
    specs: list[set[str]] = [set() for _ in range(count)]
    chosen: dict[str, int] = {}
    for seconds, _, labels, ids in sorted(chunks, key=lambda c: (-(c[0] + spawns(c[2])), c[1])):

        def after(shard: int, seconds: float = seconds, labels: frozenset[str] = labels) -> float:
            return loads[shard] + seconds + spawns(labels - specs[shard])

        best = min(range(count), key=lambda s: (after(s), s))
        loads[best] = after(best)
        specs[best] |= labels
        chosen.update(dict.fromkeys(ids, best))
    shards: list[list[str]] = [[] for _ in range(count)]
    for test in unique:
        shards[chosen[test.test_id]].append(test.test_id)
    return shards


def planned_loads(
    tests: Sequence[TestInfo], shards: Sequence[Sequence[str]], durations: Mapping[str, float]
) -> list[float]:
    """The expected seconds of each shard of a partition, spawns included."""
    cost = expected_seconds(tests, durations)
    spec_of = {t.test_id: t.spec for t in tests}
    loads = []
    for ids in shards:
        labels = {spec_of[i] for i in ids if spec_of.get(i) is not None}
        loads.append(
            sum(cost[i] for i in ids) + sum(spawn_seconds(str(s), durations) for s in labels)
        )
    return loads


def digest(value: object) -> str:
    """A short stable hash of a JSON-able value (collections and partitions)."""
    data = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:16]
