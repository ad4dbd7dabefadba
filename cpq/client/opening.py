"""The ranks open a ``--cpq-world-size`` session while this process collects.

A pytest process whose tests run on the ranks first imports the suite and collects it
(Megatron-LM's unit tests: 15-21 s on the H200 host), and each rank then builds a session
of its own from the caller's arguments — imports the conftests and test modules again and
collects — on the session's first test, after all of that (~4 s there: BENCHMARKS.md,
"Where the warm session's wall goes"). Nothing in the rank's build waits for this process's
collection: it is made from the arguments and options as they stand when the session starts
(:func:`cpq.client.items.rank_setup`). So at ``pytest_sessionstart`` — after every plugin's
and conftest's ``pytest_configure``, before collection — this process sends one task that
opens the session on a group and collects there, running no test
(:func:`cpq.rank.items.run_item` with no node id), and its first test on the ranks waits
for that task's verdict and asks for the same group (by the opening's affinity key). The
two collections overlap; the first test pays what is left of the rank's, if anything.
What overlaps is the collection after the initial conftests (pytest imports those while it
parses its options, before any ``pytest_configure``, when neither the spec nor the options
are final): a test module's imports, not the root conftest's (docs/design.md says why it is
not sent earlier, and what it measured).

What a test sees of it: the ranks collect under the caller's environment before any test, as
a fresh rank of ``torchrun -m pytest`` does (``PYTEST_CURRENT_TEST`` unset), where they used
to collect under the first test's; under ``-s`` what collection printed there is shown
before the first test's output. What it never changes is a verdict: an opening that failed
(a conftest that raises in the rank, a group that could not start, a broker that went away)
is dropped, and the first test builds the session as before and reports what it finds there;
a first test whose session is not the one opened (options changed after the session started)
ends it in the rank, as any other caller's test would. Under coverage the opening is
measured like a test (the conftests' and test modules' import-time lines) and merged.

Not sent: without ``--cpq-world-size`` (world sizes are known only from the markers, after
collection), under a launcher, with ``--collect-only``, in an xdist controller (its workers
run the tests, and each opens its own), on a pytest cpq does not support, or when there is
no broker to ask (autostart off and none running). See docs/design.md, "The calling
process's floor, and the whole session as a launch".
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pytest

from cpq.client import coverage_relay, early_warm, items
from cpq.client.items import Unusable
from cpq.client.session import CpqSession
from cpq.protocol import TaskResult

#: The opening's test id in the broker's history, timeline and status (no test has it).
TEST_ID = "(collection)"

_KEY = pytest.StashKey["Opening | None"]()


@dataclass
class Opening:
    """An opening in flight: the rank session it builds, and how to find its group."""

    key: str
    affinity: str
    future: Future[TaskResult]
    #: The coverage measurement it was sent with (its data is merged into it), or None.
    coverage: Any


class OpenAhead:
    """The plugin object (registered by :mod:`cpq.client.plugin`) that sends the opening
    last of every ``pytest_sessionstart``: a conftest's may still set an option."""

    def __init__(self, session: CpqSession) -> None:
        self.session = session

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        send(session.config, self.session)


def wanted(config: pytest.Config, session: CpqSession) -> bool:
    """Whether this pytest process opens its session on the ranks ahead (module docstring)."""
    if session.world_size is None or session.under_launcher or session.broker_gone:
        return False
    if early_warm.runs_no_test(config.option) or config.pluginmanager.has_plugin("dsession"):
        return False
    try:
        items.check_pytest()
    except Unusable:
        return False  # every test that would run on the ranks fails saying so
    return session.broker_at_hand()


def send(config: pytest.Config, session: CpqSession) -> None:
    """Send the opening (when :func:`wanted`); anything that goes wrong leaves it unsent."""
    config.stash[_KEY] = None
    if not wanted(config, session) or session.world_size is None:
        return
    key, setup = items.rank_setup(config, session.session_id)
    cov = coverage_relay.current()
    affinity = f"cpq-opening:{key}"
    try:
        future = session.client.submit_async(
            items.TARGET,
            session.world_size,
            {"session": key, "setup": setup, "nodeid": "", "path": "", "next": None},
            timeout=session.timeout,
            test_id=TEST_ID,
            roots=session.roots(),
            affinity=affinity,
            retries=0,  # an infra failure: the first test builds the session itself
            coverage=None if cov is None else coverage_relay.session_config(cov, ""),
            session=session.process_session,
            own_groups=session.own_groups or cov is not None,  # as the tests' own
        )
    except Exception:  # an optimisation: the tests connect again and report what they find
        return
    config.stash[_KEY] = Opening(key, affinity, future, cov)


def wait(
    config: pytest.Config,
    session: CpqSession,
    key: str,
    test_id: str,
    world_size: int,
    env: dict[str, str] | None,
) -> str:
    """For the session's first test on the ranks with ``--cpq-world-size``'s spec (a marker
    test of another world size or ``env`` runs elsewhere, and leaves the opening to the next
    one): wait for the opening of ``key`` and return the affinity key that asks for its
    group ("": none to ask for)."""
    opening = config.stash.get(_KEY, None)
    if opening is None or env or world_size != session.world_size:
        return ""
    config.stash[_KEY] = None
    if opening.key != key:
        return ""
    try:
        result = session.wait(opening.future, test_id)
    except Exception:  # the broker went away: the test's own submit says so
        return ""
    if config.getoption("capture", "fd") == "no":  # -s: what collection printed there
        items.stream_output(result)
    if opening.coverage is not None and result.coverage:
        coverage_relay.merge(opening.coverage, result.coverage)
    return opening.affinity if result.outcome == "passed" else ""
