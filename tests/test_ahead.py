"""Imports ahead of a session (cpq/rank/ahead.py), end to end against fresh runs: a project's
package, imported by its root conftest, is imported again by the warm rank while it waits
for the next session; that session takes it over with a fresh import's state, or — when
the package was edited in between — imports it afresh. Every session's verdicts equal a
fresh ``torchrun -m pytest``'s, and the rank's log says which of the two happened."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    VERDICTS_PLUGIN,
    fresh_verdicts,
    project_session,
    run_with_verdicts,
    start_broker,
    stop_broker,
)

pytest_plugins = ["pytester"]

FLAGS = ["-p", "verdicts", "-p", "no:cacheprovider", "-p", "no:randomly", "-rA"]

PACKAGE = """
import logging
import os
import warnings

MODE = os.environ.get("AHEAD_MODE", "unset")
SEEN = []
log = logging.getLogger("aheadpkg")
from aheadpkg import sub  # noqa: E402
"""

#: Imported by a test body, not the conftest: pytest keeps no filter set while conftest files
#: import (its warning capture wraps that), but one set by a test's import holds in the test;
#: what the import prints and warns is the test's.
QUIET = """
import warnings

warnings.filterwarnings("ignore", message="aheadquiet is quiet")
print("aheadquiet says hello")
warnings.warn("aheadquiet was imported", UserWarning)
"""

TESTS = """
import logging
import os
import warnings

import aheadpkg


def test_module_state_is_a_fresh_imports():
    assert aheadpkg.SEEN == []
    aheadpkg.SEEN.append(os.getpid())


def test_the_import_read_this_sessions_environment():
    assert aheadpkg.MODE == os.environ.get("AHEAD_MODE", "unset")


def test_the_code_is_the_files_as_they_are_now():
    assert aheadpkg.sub.VALUE == int(os.environ["EXPECT_VALUE"])


def test_the_logger_is_the_modules_own():
    assert logging.getLogger("aheadpkg") is aheadpkg.log


def test_what_the_import_set_printed_and_warned_is_this_tests(capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import aheadquiet  # noqa: F401

        assert [f for f in warnings.filters if f[1] and f[1].pattern == "aheadquiet is quiet"]
    assert [str(w.message) for w in caught] == ["aheadquiet was imported"]
    assert capsys.readouterr().out == "aheadquiet says hello\\n"
"""


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A broker of one CPU rank and no spare: every session runs on the same group."""
    state = tmp_path / "state"
    process, endpoint = start_broker(state, "--max-ranks", "1", "--spares", "0")
    try:
        yield endpoint, state / "logs"
    finally:
        stop_broker(process)


def _rank_log_says(logs: Path, text: str, timeout_s: float = 60.0) -> str:
    """Wait until a rank's log holds ``text`` (the rank logs it after its report went out,
    when it imports ahead); return the log."""
    deadline = time.monotonic() + timeout_s
    seen = ""
    while time.monotonic() < deadline:
        seen = "".join(p.read_text(errors="replace") for p in sorted(logs.glob("*rank0.log")))
        if text in seen:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"no rank log says {text!r}:\n{seen[-4000:]}")


def test_a_warm_session_takes_over_what_the_last_imported_with_a_fresh_imports_state(
    pytester: pytest.Pytester, own_broker: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, logs = own_broker
    project = pytester.path
    project_session(monkeypatch, endpoint, project)
    package = project / "aheadpkg"
    package.mkdir()
    (package / "__init__.py").write_text(PACKAGE)
    (package / "sub.py").write_text("VALUE = 1\n")
    (project / "aheadquiet.py").write_text(QUIET)
    pytester.makeconftest("import aheadpkg  # noqa: F401\n")
    pytester.makepyfile(verdicts=VERDICTS_PLUGIN, test_pkg=TESTS)
    command = [sys.executable, "-m", "pytest", "--cpq-world-size", "1", *FLAGS, "test_pkg.py"]

    def compare(name: str, **env: str) -> None:
        reference, fresh = fresh_verdicts(
            [*FLAGS, "-p", "no:cpq", "test_pkg.py"], f"fresh-{name}", project, nproc=1, **env
        )
        assert set(reference.values()) == {"passed"}, fresh.stdout[-3000:]
        run = run_with_verdicts(command, project / name, project, **env)
        got = json.loads((project / f"{name}-client.json").read_text())
        assert got == reference, f"{name}: {got} != {reference}\n{run.stdout[-4000:]}"

    compare("cold", EXPECT_VALUE="1")
    _rank_log_says(logs, "imported ahead of the next session")
    compare("warm", EXPECT_VALUE="1")
    _rank_log_says(logs, "modules were taken over")
    # An edit between sessions: the modules imported ahead are dropped, the session
    # imports the package as it is now, as a fresh process does.
    (package / "sub.py").write_text("VALUE = 22\n")
    compare("edited", EXPECT_VALUE="22")
    log = _rank_log_says(logs, "were dropped: ")
    assert "sub.py changed" in log, log[-3000:]
    assert len(list(logs.glob("*rank0.log"))) == 1  # one group served every session
