"""Which pytest cpq supports, said once and kept in step: pyproject's requirement, the bounds
the plugin fails closed on (``cpq.client.items.PYTEST_SUPPORTED``) and the versions
``tools/test.sh`` tests in its second environment (the oldest allowed, the newest release;
bump the newest there when pytest releases, and the upper bound here when it is tested).
And the ``cpq`` marker's checks: a marker cpq cannot use fails its own test, naming why."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from cpq.client import items

ROOT = Path(__file__).resolve().parents[2]


def _bounds() -> tuple[tuple[int, int], tuple[int, int]]:
    # project.dependencies' line (tomllib is Python 3.11+; cpq supports 3.10)
    (spec,) = re.findall(r'^\s*"(pytest[<>=][^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M)
    low = re.search(r">=\s*([\d.]+)", spec)
    high = re.search(r"<\s*([\d.]+)", spec)
    assert low and high, f"pyproject's {spec!r} needs both bounds"
    return _version(low[1]), _version(high[1])


def _version(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor.partition(".")[0] or 0)


def _tested_versions() -> list[str]:
    script = (ROOT / "tools" / "test.sh").read_text()
    found = re.search(r'^tested_pytests="\$\{CPQ_PYTEST_VERSIONS-([\d. ]+)\}"$', script, re.M)
    assert found, "tools/test.sh names its default pytest versions"
    return found[1].split()


def test_pyproject_and_the_plugin_support_the_same_pytests() -> None:
    low, high = _bounds()
    first, beyond = items.PYTEST_SUPPORTED
    assert (low, high) == (first, beyond)


def test_ci_tests_the_oldest_allowed_and_a_newest_below_the_bound() -> None:
    oldest, newest = _tested_versions()
    low, high = _bounds()
    assert oldest == f"{low[0]}.{low[1]}.0", "the oldest pytest pyproject allows"
    assert low < _version(newest) < high
    for suite in re.findall(r"tests/test_\w+\.py", (ROOT / "tools" / "test.sh").read_text()):
        assert (ROOT / suite).is_file(), suite


@pytest.mark.parametrize("version", ["8.2.0", "8.4.2", "9.0.3", "9.2.0", "9.99.1.dev3"])
def test_a_supported_pytest_passes(version: str) -> None:
    items.check_pytest(version)


@pytest.mark.parametrize("version", ["7.4.4", "8.1.2", "10.0.0", "10.0.0rc1", "x.y"])
def test_another_pytest_fails_closed_naming_the_supported_ones(version: str) -> None:
    with pytest.raises(
        items.Unusable, match=rf"pytest 8\.2 up to .* 10\.0; this is pytest {version}"
    ):
        items.check_pytest(version)


class _Item:
    """What :func:`cpq.client.items.marker_args` reads of a test: its closest marker."""

    def __init__(self, mark: Any) -> None:
        self.mark = mark

    def get_closest_marker(self, name: str) -> Any:
        return self.mark if name == "cpq" else None


def _args(*args: Any, **kwargs: Any) -> Any:
    return items.marker_args(_Item(pytest.mark.cpq(*args, **kwargs).mark))  # type: ignore[arg-type]


def test_a_marker_cpq_can_use() -> None:
    assert items.marker_args(_Item(None)) is None  # type: ignore[arg-type]
    assert _args() == (2, None, None)
    assert _args(4) == (4, None, None)
    assert _args(world_size=1, timeout=5, env={"A": "1"}) == (1, 5.0, {"A": "1"})
    assert _args(world_size=2, affinity="k", own_groups=True) == (2, None, None)


@pytest.mark.parametrize(
    ("args", "kwargs", "why"),
    [
        ((), {"world_size": "2"}, "world_size must be an int of at least 1, got '2'"),
        ((), {"world_size": 0}, "world_size must be an int of at least 1, got 0"),
        ((), {"world_size": True}, "world_size must be an int of at least 1, got True"),
        (("2",), {}, "world_size must be an int of at least 1, got '2'"),
        ((2, 3), {}, "one positional argument"),
        ((), {"world_sise": 2}, "unknown argument(s) world_sise (it takes world_size,"),
        ((), {"timeout": "5"}, "timeout must be a positive number of seconds, got '5'"),
        ((), {"timeout": 0}, "timeout must be a positive number of seconds, got 0"),
        ((), {"env": {"A": 1}}, "env must be a dict of strings, got {'A': 1}"),
        ((), {"env": [("A", "1")]}, "env must be a dict of strings"),
    ],
)
def test_a_marker_cpq_cannot_use_names_the_problem(
    args: tuple[Any, ...], kwargs: dict[str, Any], why: str
) -> None:
    with pytest.raises(items.Unusable) as raised:
        _args(*args, **kwargs)
    assert str(raised.value).startswith("cpq marker: ")
    assert why in str(raised.value)


def test_a_rank_whose_pytest_is_not_the_callers_refuses_the_task(tmp_path: Path) -> None:
    """The ranks rebuild the caller's session with the caller's pytest: another one (an
    upgrade under a warm group, another interpreter's) is refused before anything is built."""
    from cpq.rank.items import RankSession

    with pytest.raises(RuntimeError, match=rf"pytest {re.escape(pytest.__version__)}, the calling"):
        RankSession("key", {"dir": str(tmp_path), "pytest": "8.2.0.dev1"}, 0)
