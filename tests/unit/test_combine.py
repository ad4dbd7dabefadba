"""The ranks' reports combined (cpq.client.combine), printed by pytest's own writer: every
section cpq adds sits under pytest's full-width separator, whatever the failure's report is
(a traceback, or a text: a fixture not found, a strict XPASS), and another rank's report
keeps its first line's indentation."""

from __future__ import annotations

import io
from typing import Any

import pytest
from _pytest._io import TerminalWriter

from cpq.client import combine

WIDTH = 120


def _printed(report: pytest.TestReport) -> list[str]:
    """The report as pytest's terminal prints a failure, ``WIDTH`` columns wide: its long
    report, then each of its sections under a separator (``TerminalReporter``'s
    ``_outrep_summary``)."""
    out = io.StringIO()
    writer = TerminalWriter(out)
    writer.hasmarkup = False
    writer.fullwidth = WIDTH
    report.toterminal(writer)
    for name, content in report.sections:
        writer.sep("-", name)
        writer.line(content)
    return out.getvalue().splitlines()


def _boom(exc: BaseException) -> None:
    raise exc


def _traceback(exc: BaseException) -> Any:
    """pytest's long report of ``exc`` raised in :func:`_boom`, that frame only (as a
    test's own frame is all a rank's report shows)."""
    try:
        _boom(exc)
    except BaseException as raised:
        info = pytest.ExceptionInfo.from_exception(raised)
        info.traceback = info.traceback[-1:]
        return info.getrepr(style="long")
    raise AssertionError("unreachable")


def _report(longrepr: Any, when: str = "call", outcome: str = "failed") -> pytest.TestReport:
    return pytest.TestReport("t.py::test_x", ("t.py", 1, "test_x"), {}, outcome, longrepr, when)  # type: ignore[arg-type]


def _separator(line: str, title: str) -> bool:
    return f" {title} " in line and line.startswith("---") and len(line) >= WIDTH - 1


@pytest.mark.parametrize(
    ("when", "text"),
    [
        (
            "setup",
            "file t.py, line 2\n  def test_x(golden_sizes):\nE  fixture 'golden_sizes' not found",
        ),
        ("call", "[XPASS(strict)] fixed on every rank"),
    ],
    ids=["error-fixture-not-found", "xpass-strict"],
)
def test_a_text_reports_sections_under_pytests_full_width_separator(when: str, text: str) -> None:
    base = _report(text, when)
    combined = combine.combine_phase([(0, base), (1, _report(text, when))], 2, "g1-x")
    lines = _printed(combined)
    assert lines[: len(text.splitlines())] == text.splitlines()
    (cpq,) = [line for line in lines if " cpq " in line]
    assert _separator(cpq, "cpq"), cpq  # not a short "---- cpq ----"
    assert lines[-1].startswith("failed on rank(s) [0, 1] of 2 (group g1-x)")
    # As a string (JUnit's message, the short summary): the text alone, as in a fresh run.
    assert str(combined.longrepr) == text


def test_another_ranks_text_report_is_a_full_width_section_too() -> None:
    first = _report("E  fixture 'a' not found", "setup")
    other = _report("E  fixture 'b' not found", "setup")
    lines = _printed(combine.combine_phase([(0, first), (1, other)], 2, "g1-x"))
    rank1 = lines.index(next(line for line in lines if " rank 1 " in line))
    assert _separator(lines[rank1], "rank 1") and lines[rank1 + 1] == "E  fixture 'b' not found"
    assert _separator(next(line for line in lines if " cpq " in line), "cpq")


def test_another_ranks_traceback_keeps_its_first_lines_indentation() -> None:
    first = _report(_traceback(ValueError("rank 0 says")))
    other = _report(_traceback(KeyError("rank 1 says")))
    assert other.longreprtext.startswith("def _boom")  # pytest strips the report's text
    lines = _printed(combine.combine_phase([(0, first), (1, other)], 2, "g1-x"))
    rank1 = lines.index(next(line for line in lines if " rank 1 " in line))
    assert _separator(lines[rank1], "rank 1")
    assert lines[rank1 + 1] == "    def _boom(exc: BaseException) -> None:", lines[
        rank1 : rank1 + 3
    ]
    assert any("KeyError: 'rank 1 says'" in line for line in lines[rank1:])
    assert _separator(next(line for line in lines if " cpq " in line), "cpq")


def test_the_same_report_on_every_rank_is_named_once() -> None:
    reports = [(rank, _report(_traceback(ValueError("same")))) for rank in (0, 1)]
    lines = _printed(combine.combine_phase(reports, 2, "g1-x"))
    assert not [line for line in lines if " rank 1 " in line]
    assert lines[-1].endswith("the report above is rank 0's, the same on rank(s) [1]")


def test_reports_that_differ_only_in_object_addresses_are_the_same_report() -> None:
    """Each rank's objects live at other addresses: ``assert x is True`` on an object fails
    with the same words but another ``0x...``; the ranks are named once, not shown twice."""
    reports = [
        (rank, _report(_traceback(AssertionError(f"assert <object object at {addr}> is True"))))
        for rank, addr in ((0, "0x7f3a2c1b9e40"), (1, "0x7f11d0a4be50"))
    ]
    lines = _printed(combine.combine_phase(reports, 2, "g1-x"))
    assert not [line for line in lines if " rank 1 " in line]
    assert lines[-1].endswith("the report above is rank 0's, the same on rank(s) [1]")
