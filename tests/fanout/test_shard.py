"""The partition and shard-spec parsing, as pure functions (milliseconds, no processes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpq.fanout.shard import (
    DEFAULT_SPAWN_S,
    SPAWN_PREFIX,
    ShardError,
    ShardSpec,
    TestInfo,
    expected_seconds,
    parse_shard,
    partition,
    planned_loads,
    shard_from_env,
    spawn_seconds,
    spec_label,
)

ids = st.lists(st.text(alphabet="abcdefghij:/[]-_0123456789", min_size=1, max_size=12), max_size=40)


@st.composite
def suites(draw: st.DrawFn) -> tuple[list[TestInfo], dict[str, float], int]:
    names = draw(st.lists(st.text("abcdef_:[]0123", min_size=1, max_size=10), unique=True))
    specs = st.sampled_from([None, "ws1", "ws2", "ws2 X=1"])
    tests = [TestInfo(n, draw(specs)) for n in names]
    known = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    seconds = st.floats(min_value=0, max_value=1e4, allow_nan=False)
    recorded = {n: draw(seconds) for n in known}
    if draw(st.booleans()):
        recorded[SPAWN_PREFIX + "ws2"] = draw(seconds)
    return tests, recorded, draw(st.integers(min_value=1, max_value=9))


@settings(max_examples=150, deadline=None)
@given(suites())
def test_every_test_lands_in_exactly_one_shard(
    suite: tuple[list[TestInfo], dict[str, float], int],
) -> None:
    tests, recorded, count = suite
    shards = partition(tests, count, recorded)
    assert len(shards) == count
    flat = [i for shard in shards for i in shard]
    assert sorted(flat) == sorted(t.test_id for t in tests)  # all, and each once
    order = {t.test_id: n for n, t in enumerate(tests)}
    for shard in shards:  # each shard keeps collection order
        assert [order[i] for i in shard] == sorted(order[i] for i in shard)


@settings(max_examples=100, deadline=None)
@given(suites(), st.randoms(use_true_random=False))
def test_partition_is_a_function_of_the_set_of_tests(
    suite: tuple[list[TestInfo], dict[str, float], int], rng: object
) -> None:
    """Every shard computes the same partition, whatever order it collected in."""
    tests, recorded, count = suite
    shuffled = list(tests)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    first = [set(s) for s in partition(tests, count, recorded)]
    again = [set(s) for s in partition(shuffled, count, dict(reversed(recorded.items())))]
    assert first == again


def test_longest_first_onto_the_least_loaded_shard() -> None:
    tests = [TestInfo(n) for n in "abcdef"]
    recorded = {"a": 7, "b": 5, "c": 4, "d": 3, "e": 2, "f": 2}
    assert [set(s) for s in partition(tests, 2, recorded)] == [{"a", "d", "f"}, {"b", "c", "e"}]
    assert planned_loads(tests, partition(tests, 2, recorded), recorded) == [12, 11]


def test_unknown_tests_count_at_the_median_of_known_ones() -> None:
    tests = [TestInfo("slow"), TestInfo("x1"), TestInfo("x2"), TestInfo("new")]
    recorded = {"slow": 10.0, "x1": 1.0, "x2": 3.0}  # median 3: new costs 3
    loads = planned_loads(tests, partition(tests, 2, recorded), recorded)
    assert sorted(loads) == [7.0, 10.0]


def test_with_nothing_recorded_shards_get_equal_counts() -> None:
    tests = [TestInfo(f"t{i:02d}") for i in range(10)]
    assert [len(s) for s in partition(tests, 3, {})] == [4, 3, 3]


def test_a_shard_pays_each_spec_spawn_once() -> None:
    """With spawns dear, tests of a spec stay together rather than spawning it everywhere."""
    tests = [TestInfo(f"a{i}", "ws2") for i in range(4)] + [
        TestInfo(f"b{i}", "ws1") for i in range(4)
    ]
    recorded = {t.test_id: 1.0 for t in tests} | {SPAWN_PREFIX + "ws2": 20.0}
    shards = partition(tests, 2, recorded)
    assert {frozenset(s) for s in shards} == {
        frozenset(f"a{i}" for i in range(4)),
        frozenset(f"b{i}" for i in range(4)),
    }
    loads = planned_loads(tests, shards, recorded)
    assert sorted(loads) == [4 + DEFAULT_SPAWN_S, 24.0]


def test_unmarked_tests_pay_no_spawn() -> None:
    tests = [TestInfo("m", "ws2"), TestInfo("u1"), TestInfo("u2")]
    recorded = {"m": 1.0, "u1": 1.0, "u2": 1.0}
    loads = planned_loads(tests, partition(tests, 2, recorded), recorded)
    assert sorted(loads) == [2.0, 1.0 + DEFAULT_SPAWN_S]


def test_spec_labels() -> None:
    assert spec_label(2) == "ws2"
    assert spec_label(4, {"B": "1", "A": "x y"}) == "ws4 A=x y B=1"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"CPQ_SHARD": "2/3"}, ShardSpec(2, 3, "CPQ_SHARD")),
        (
            {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "3"},
            ShardSpec(1, 3, "SLURM_ARRAY_TASK_ID"),
        ),
        (
            {
                "SLURM_ARRAY_TASK_ID": "4",
                "SLURM_ARRAY_TASK_COUNT": "4",
                "SLURM_ARRAY_TASK_MIN": "1",
                "SLURM_ARRAY_TASK_MAX": "4",
            },
            ShardSpec(3, 4, "SLURM_ARRAY_TASK_ID"),
        ),
        (
            {"JOB_COMPLETION_INDEX": "0", "CPQ_SHARD_COUNT": "2"},
            ShardSpec(0, 2, "JOB_COMPLETION_INDEX"),
        ),
        (  # CPQ_SHARD wins over the scheduler's variables
            {"CPQ_SHARD": "0/1", "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "3"},
            ShardSpec(0, 1, "CPQ_SHARD"),
        ),
    ],
)
def test_shard_from_env(env: dict[str, str], expected: ShardSpec | None) -> None:
    assert shard_from_env(env) == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CPQ_SHARD": "3/3"}, "not in 0..2"),
        ({"CPQ_SHARD": "1-3"}, "expected I/N"),
        ({"CPQ_SHARD": "0/0"}, "at least 1"),
        ({"JOB_COMPLETION_INDEX": "1"}, "CPQ_SHARD_COUNT is not"),
        ({"JOB_COMPLETION_INDEX": "x", "CPQ_SHARD_COUNT": "2"}, "not an integer"),
        (
            {
                "SLURM_ARRAY_TASK_ID": "3",
                "SLURM_ARRAY_TASK_COUNT": "3",
                "SLURM_ARRAY_TASK_MIN": "1",
                "SLURM_ARRAY_TASK_MAX": "5",
            },
            "contiguous array",
        ),
    ],
)
def test_bad_shards_are_clear_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(ShardError, match=message):
        shard_from_env(env)


def test_parse_shard_tolerates_spaces() -> None:
    assert parse_shard(" 1 / 2 ") == ShardSpec(1, 2)


@st.composite
def grouped_suites(draw: st.DrawFn) -> tuple[list[TestInfo], dict[str, float], int]:
    """Suites whose tests belong to modules (``mN.py``) and some to classes in them."""
    size = draw(st.integers(min_value=0, max_value=30))
    specs = st.sampled_from([None, "ws1", "ws2"])
    tests = []
    for n in range(size):
        module = f"m{draw(st.integers(0, 5))}.py"
        cls = draw(st.sampled_from(["", "::A", "::B"]))
        tests.append((f"{module}{cls}::t{n}", draw(specs), module, module + cls))
    seconds = st.floats(min_value=0, max_value=100, allow_nan=False)
    recorded = {t[0]: draw(seconds) for t in tests if draw(st.booleans())}
    if draw(st.booleans()):
        recorded[SPAWN_PREFIX + "ws2"] = draw(seconds)
    by = draw(st.sampled_from(["test", "module", "class"]))
    infos = [
        TestInfo(i, spec, {"test": "", "module": module, "class": cls if "::A" in i or "::B" in i
                           else ""}[by])
        for i, spec, module, cls in tests
    ]  # fmt: skip
    return infos, recorded, draw(st.integers(min_value=1, max_value=6))


@settings(max_examples=200, deadline=None)
@given(grouped_suites())
def test_a_group_lands_on_one_shard_and_balance_keeps_the_greedy_bound(
    suite: tuple[list[TestInfo], dict[str, float], int],
) -> None:
    """Each module (class) on one shard, every test once; and the greedy bound holds: no
    shard's planned load exceeds the mean load by more than the largest thing placed whole
    (a unit of tests with its spawns, or one spec's tests with its spawn)."""
    tests, recorded, count = suite
    shards = partition(tests, count, recorded)
    assert sorted(i for s in shards for i in s) == sorted(t.test_id for t in tests)
    where = {i: n for n, s in enumerate(shards) for i in s}
    groups: dict[str, set[int]] = {}
    for t in tests:
        if t.group:
            groups.setdefault(t.group, set()).add(where[t.test_id])
    assert all(len(found) == 1 for found in groups.values()), groups
    loads = planned_loads(tests, shards, recorded)
    cost = expected_seconds(tests, recorded)
    units: dict[str, list[TestInfo]] = {}
    for t in tests:
        units.setdefault(t.group or "\0" + t.test_id, []).append(t)
    largest = [
        sum(cost[t.test_id] for t in members)
        + sum(spawn_seconds(s, recorded) for s in {t.spec for t in members if t.spec})
        for members in units.values()
    ]
    for spec in {t.spec for t in tests if t.spec}:
        own = sum(cost[t.test_id] for t in tests if t.spec == spec)
        largest.append(own + spawn_seconds(spec, recorded))
    if tests:
        assert max(loads) <= sum(loads) / count + max(largest) + 1e-6


def test_by_module_each_module_stays_whole_and_balanced() -> None:
    tests = [TestInfo(f"a.py::t{n}", group="a.py") for n in range(4)]
    tests += [TestInfo(f"b.py::t{n}", group="b.py") for n in range(2)]
    tests += [TestInfo(f"c.py::t{n}", group="c.py") for n in range(2)]
    shards = partition(tests, 2, {})  # 1 s each: a.py (4) alone, b.py and c.py together
    assert [set(s) for s in shards] == [
        {f"a.py::t{n}" for n in range(4)},
        {f"{m}.py::t{n}" for m in "bc" for n in range(2)},
    ]
    alone = partition([TestInfo(t.test_id) for t in tests], 2, {})  # by test: split by count
    assert [len(s) for s in alone] == [4, 4] and set(alone[0]) != set(shards[0])


def test_modules_of_one_spec_share_a_shard_when_a_spawn_is_dear() -> None:
    tests = [TestInfo(f"a.py::t{n}", "ws2", "a.py") for n in range(3)]
    tests += [TestInfo(f"b.py::t{n}", "ws2", "b.py") for n in range(3)]
    tests += [TestInfo(f"c.py::t{n}", None, "c.py") for n in range(6)]
    recorded = {t.test_id: 1.0 for t in tests[:6]} | {t.test_id: 5.0 for t in tests[6:]}
    recorded[SPAWN_PREFIX + "ws2"] = 30.0  # one spawn of ws2: a.py and b.py together
    shards = partition(tests, 2, recorded)
    assert {frozenset(s) for s in shards} == {
        frozenset(t.test_id for t in tests[:6]),
        frozenset(t.test_id for t in tests[6:]),
    }
    assert sorted(planned_loads(tests, shards, recorded)) == [30.0, 36.0]
