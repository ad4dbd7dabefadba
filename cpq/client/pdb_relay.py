"""``pytest --pdb`` for cpq tests: the post-mortem runs in the failing rank, on your terminal.

With ``--pdb``, the plugin submits marker tests with ``debug_rank`` (``--cpq-pdb-rank N``,
default: the lowest failing rank). A failing rank keeps its frames; the verdict names it;
pytest's own post-mortem hook (``PdbInvoke``) is wrapped so that, for such a failure, the
report is shown as pytest shows it and then the debugger of *that rank* runs, with its
prompt, output and your lines relayed through the broker (``cpq.broker.debugging``,
``cpq.rank.pdb_relay``). ``c`` ends it and the session goes on; ``q`` ends the session as
pytest's ``q`` does. The group is recycled after. Every other failure (and every failure a
broker without the relay reports) goes to pytest's own debugger unchanged.
"""

from __future__ import annotations

import queue
import sys
from typing import Any

import pytest

from cpq.client.report import CpqTaskFailed

#: A relayed session that pytest never opened (xfail, say) is given up at teardown.
PENDING_KEY = pytest.StashKey[tuple[Any, str]]()


def add_options(group: pytest.OptionGroup) -> None:
    group.addoption(
        "--cpq-pdb-rank",
        type=int,
        default=None,
        metavar="N",
        help="with --pdb: debug rank N of a failing cpq test when it failed "
        "(default: the lowest failing rank)",
    )


def debug_rank(config: pytest.Config) -> int | None:
    """What a submit asks for: None without ``--pdb``, else the rank to debug (-1: lowest)."""
    if not config.getoption("usepdb", False):
        return None
    wanted = config.getoption("cpq_pdb_rank")
    return -1 if wanted is None else int(wanted)


def wrap_pdb_invoke(config: pytest.Config) -> None:
    """Put :class:`RelayingPdbInvoke` in front of pytest's ``--pdb`` plugin."""
    manager = config.pluginmanager
    inner = manager.get_plugin("pdbinvoke")
    if inner is None or isinstance(inner, RelayingPdbInvoke):
        return
    manager.unregister(inner)
    manager.register(RelayingPdbInvoke(inner), "pdbinvoke")


def remember(item: pytest.Item, client: Any, task_id: str) -> None:
    item.stash[PENDING_KEY] = (client, task_id)


def release_pending(item: pytest.Item) -> None:
    """Give up a post-mortem pytest did not open, so its group is recycled now."""
    pending = item.stash.get(PENDING_KEY, None)
    if pending is not None:
        del item.stash[PENDING_KEY]
        client, task_id = pending
        client.debug_release(task_id)


class RelayingPdbInvoke:
    """pytest's ``PdbInvoke``, except for cpq failures whose rank waits for a debugger."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def pytest_exception_interact(
        self, node: pytest.Item, call: pytest.CallInfo[Any], report: pytest.TestReport
    ) -> None:
        pending = node.stash.get(PENDING_KEY, None)
        failed = call.excinfo.value if call.excinfo is not None else None
        if pending is None or not isinstance(failed, CpqTaskFailed):
            self.inner.pytest_exception_interact(node, call, report)
            return
        del node.stash[PENDING_KEY]
        capman = node.config.pluginmanager.getplugin("capturemanager")
        if capman:
            capman.suspend_global_capture(in_=True)
            out, err = capman.read_global_capture()
            sys.stdout.write(out)
            sys.stdout.write(err)
        reporter = node.config.pluginmanager.getplugin("terminalreporter")
        tw = reporter._tw
        tw.line()
        showcapture = node.config.option.showcapture
        for name, content in (  # what the failing rank's test printed, as pytest shows it
            ("stdout", report.capstdout),
            ("stderr", report.capstderr),
            ("log", report.caplog),
        ):
            if showcapture in (name, "all") and content:
                tw.sep(">", "captured " + name)
                tw.line(content[:-1] if content.endswith("\n") else content)
        tw.sep(">", "traceback")
        report.toterminal(tw)
        tw.sep(">", f"entering PDB on rank {failed.result.debug_rank} (relayed by cpq)")
        report._pdbshown = True  # type: ignore[attr-defined]
        client, task_id = pending
        if relay(client, task_id, sys.stdin, sys.stdout):
            pytest.exit("Quitting debugger")

    def pytest_internalerror(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        self.inner.pytest_internalerror(excinfo)


def relay(client: Any, task_id: str, stdin: Any, stdout: Any) -> bool:
    """Run the rank's debugger on this terminal until it ends; True: the user quit."""
    output = client.debug_attach(task_id)
    while True:
        try:
            message = output.get(timeout=1.0)
        except queue.Empty:
            continue  # the client's I/O thread puts an ``ended`` here if the broker goes
        stdout.write(message.text)
        stdout.flush()
        if message.ended:
            return bool(message.quit)
        if message.prompt:
            line = stdin.readline()
            client.debug_line(task_id, line.rstrip("\r\n"), eof=not line)
