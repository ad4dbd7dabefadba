"""How a verdict from the ranks becomes a pytest report (the plugin's reporting half).

For what ``cpq.run`` (the fixture) gets back, and for a test run on the ranks whose verdict
carries no reports of theirs (a deadline, a dead rank: cpq's infra error). A failing rank's
traceback is the report, as a local failure's would be; other ranks' different errors and
every rank's output are report sections; retry notes go to the test's stderr (so JUnit's
``<system-err>`` has them); a skip on every rank is a skip. A test the ranks ran through
pytest is reported from their own reports instead (:mod:`cpq.client.combine`).
"""

from __future__ import annotations

import os
import re
import sys

import pytest
from _pytest._code.code import (
    ReprEntryNative,
    ReprExceptionInfo,
    ReprFileLocation,
    ReprTraceback,
)

from cpq import protocol
from cpq.protocol import TaskResult

#: Where the body took its skip (file, line), for the report's location.
SKIP_LOCATION_KEY = pytest.StashKey[tuple[str, int]]()
_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line (?P<line>\d+)', re.M)
#: Frames of these packages are not where the user's skip is (pytest.skip's own frames).
_NOT_USER = (os.path.dirname(os.path.dirname(os.path.abspath(pytest.__file__))) + os.sep,)


class BrokerGone(pytest.fail.Exception):  # type: ignore[name-defined,misc]
    """pytest's failure (``pytest.fail``) saying the broker is gone: a test's own failure
    raised during the wait (pytest-timeout's, in setup) is not this one."""


class CpqTaskFailed(Exception):
    """A task failed or errored on the ranks; its report is built from the ranks' reports."""

    def __init__(self, result: TaskResult, target: str) -> None:
        super().__init__(result.message or result.outcome)
        self.result = result
        self.target = target

    def longrepr(self) -> str:
        """The report, laid out as a fresh run's: the failing rank's report as pytest printed
        it there (its ``>`` and ``E`` lines; the Python traceback where the rank ran no
        pytest), what cpq adds (a deadline's per-rank stacks, retry notes), and one last line
        saying which ranks failed. An infra error says so first: no user code is to blame."""
        result = self.result
        ranks = result.failed_ranks
        first_line, _, rest = (result.message or result.outcome).partition("\n")
        first = next((r for r in ranks if r.error is not None), None)
        detail = [_detail(first)] if first is not None else []
        if result.outcome == "error":
            lines = [f"cpq infra error running {self.target}: {first_line}", *result.notes]
            return "\n".join([*lines, *([rest] if rest else []), *detail])
        lines = [*detail, *([first_line] if result.message else []), *result.notes]
        lines += [rest] if rest else []
        failing = [r.rank for r in ranks] or sorted(r.rank for r in result.ranks)
        whose = f"; the report above is rank {first.rank}'s" if detail and first else ""
        lines.append(
            f"cpq: failed on rank(s) {failing} of {len(result.ranks)} "
            f"(group {result.group_id}){whose}"
        )
        return "\n".join(lines)

    def crash(self) -> str:
        """The one line pytest's short summary and JUnit's ``message`` show: the failing
        rank's exception as pytest words it (``assert 1 == 2``, ``ValueError: bad``), else
        the verdict's own first line (a deadline, an infra error)."""
        result = self.result
        first = next((r for r in result.failed_ranks if r.error is not None), None)
        if result.outcome == "failed" and first is not None and first.error is not None:
            error = first.error
            if error.type == "AssertionError" and error.message.startswith("assert "):
                return error.message  # a rewritten assert: pytest drops the type, too
            return f"{error.type}: {error.message}" if error.message else error.type
        return self.longrepr().partition("\n")[0]


def report_result(item: pytest.Item, result: TaskResult, target: str) -> None:
    """Turn a verdict into this test's outcome (the shared path of marker and fixture)."""
    for note in result.notes:  # in the captured stderr, so JUnit's <system-err> has them
        sys.stderr.write(note + "\n")
    failed = result.failed_ranks
    streaming = item.config.getoption("capture", "fd") == "no"  # -s: show it, like a local run
    for rank in result.ranks:
        for stream, text in (("stdout", rank.stdout), ("stderr", rank.stderr)):
            if not text:
                continue
            # Every line keeps its rank: JUnit's <system-out> joins the sections unlabelled.
            labelled = "".join(f"[rank {rank.rank}] {line}" for line in text.splitlines(True))
            if streaming:
                out = sys.stdout if stream == "stdout" else sys.stderr
                out.write(labelled)
                out.flush()
            else:
                item.add_report_section("call", f"{stream} rank {rank.rank}", labelled)
    shown = {_detail(failed[0])} if failed and failed[0].error else set()
    for rank in failed[1:]:
        if rank.error is not None:
            text = _detail(rank)
            if text in shown:  # every rank failed alike: the report shows it once
                continue
            shown.add(text)
            item.add_report_section("call", f"error rank {rank.rank}", text)
    if result.outcome == "passed":
        return
    if result.outcome == "skipped":
        first = result.ranks[0].error if result.ranks else None
        location = skip_location(first.traceback if first is not None else "")
        if location is not None:
            item.stash[SKIP_LOCATION_KEY] = location
        pytest.skip(result.message or "skipped on every rank")
    raise CpqTaskFailed(result, target)


def _detail(rank: protocol.RankResult) -> str:
    """A failed rank's own report: pytest's rendering, else its traceback or message."""
    error = rank.error
    if error is None:
        return ""
    return rank.report or error.traceback or f"{error.type}: {error.message}"


def skip_location(traceback: str) -> tuple[str, int] | None:
    """The user's frame that took a skip on a rank (its traceback's last frame outside
    pytest and cpq): a fresh run reports the skip there, not where cpq re-raised it."""
    found = None
    for match in _FRAME.finditer(traceback):
        path = match["path"]
        if not path.startswith(_NOT_USER) and "/_pytest/" not in path:
            found = (path, int(match["line"]))
    return found


def ranks_repr(failed: CpqTaskFailed, path: str) -> ReprExceptionInfo:
    """A failed task's report as pytest's own exception report: the whole text in the
    failure section (one native entry: it is already laid out), :meth:`CpqTaskFailed.crash`
    in the short summary and JUnit's ``message``. Being pytest's own kind, it crosses
    xdist's report serialisation whole; a plain-text report would lose the crash line there
    and put the whole text into JUnit's ``message``."""
    text = failed.longrepr()
    entry = ReprEntryNative(lines=[line + "\n" for line in text.splitlines()])
    return ReprExceptionInfo(
        reprtraceback=ReprTraceback(reprentries=[entry], extraline=None, style="native"),
        reprcrash=ReprFileLocation(path, 0, failed.crash()),
    )
