"""One real broker for the whole test session (dogfooding cpq in its own tests).

Every test that needs groups talks to this broker, so a warm ws=2 gloo group started by the
first test serves all later ones; tests that must kill groups use their own pool spec (an
``env`` override) so they never take the shared warm group down. Tests that must kill the
broker itself start a private one with :func:`start_broker`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from cpq import Client
from cpq.client.autostart import spawn_broker, stop_broker

ROOT = Path(__file__).resolve().parents[1]


def start_broker(state_dir: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """A real ``cpq-broker`` process on a private ipc endpoint, serving when this returns."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    endpoint = f"ipc://{state_dir / 'broker.sock'}"
    if "--memory" not in args:
        args = (*args, "--memory", str(TEST_BROKER_MEMORY_MB))
    process = spawn_broker(
        endpoint,
        args,
        # this process's environment as it is: a --warm spec the broker builds from it has
        # the same start variables (PYTHONPATH too) as the specs this suite's clients send
        env=dict(os.environ, CPQ_STATE_DIR=str(state_dir)),
        log_path=state_dir / "broker.stdout",
        cwd=ROOT,
    )
    return process, endpoint


_shared: dict[str, object] = {}

#: What the idle CPU groups of each broker this suite starts may hold (``--memory``). The
#: broker's default, half of the memory available at its start, is a node's whole budget:
#: this suite runs a dozen brokers and fresh ``torchrun`` references side by side on CI's
#: 24 GiB. With the default the shared broker alone kept 45 idle groups (12 GB) warm, the
#: run peaked at 19.7 GiB used, and a CI run took 73 minutes and lost a broker's heartbeats.
#: 3 GB keeps a dozen idle ranks: the groups a test file reuses, least recently used evicted
#: first (BENCHMARKS.md, "The suite's memory on CI's machine").
TEST_BROKER_MEMORY_MB = 3000


def _unit_tier_only(config: pytest.Config) -> bool:
    """True when every path pytest was given lies in tests/unit."""
    unit = ROOT / "tests" / "unit"
    here = config.invocation_params.dir
    given = [(here / arg.split("::")[0]).resolve() for arg in config.args]
    return bool(given) and all(p == unit or unit in p.parents for p in given)


def pytest_configure(config: pytest.Config) -> None:
    """Start the shared broker before the session starts.

    The cpq plugin may warm pools at ``pytest_sessionstart`` (from pytest's cache), which
    comes before any fixture: CPQ_ENDPOINT must already name this broker by then, or the
    plugin would talk to (and autostart) a broker on the default endpoint instead.
    """
    if hasattr(config, "workerinput"):
        return  # an xdist worker of this suite: the controller's broker is in os.environ
    if "CPQ_GROUP_ID" in os.environ:
        return  # a cpq rank rebuilding a session of this suite: its broker is the caller's
    if _unit_tier_only(config):
        return  # tests/unit runs without processes or sockets (tests/unit/conftest.py)
    state = Path(tempfile.mkdtemp(prefix="cpq-test-state-"))
    state.chmod(0o700)
    process, endpoint = start_broker(
        state, "--max-ranks", "6", "--spares", "0"
    )  # spares: test_spares
    names = (
        "CPQ_ENDPOINT",
        "CPQ_STATE_DIR",
        "PYTEST_ADDOPTS",
        "CPQ_WARM_CALLER",
        "CPQ_BROKER_ARGS",
    )
    _shared.update(process=process, endpoint=endpoint, state=state)
    _shared["old_env"] = {k: os.environ.get(k) for k in names}
    os.environ["CPQ_ENDPOINT"] = endpoint
    os.environ["CPQ_STATE_DIR"] = str(state)
    # The inner sessions that autostart a broker of their own (a HOME or state directory
    # of their own) keep to the same budget, unless a test sets the variable itself.
    os.environ.setdefault("CPQ_BROKER_ARGS", f"--memory {TEST_BROKER_MEMORY_MB}")
    # The inner sessions (hundreds, each of its own rootdir) keep no warm caller each: on
    # this suite's two cores they would compete with the tests. tests/test_warm_caller.py
    # turns it on for its own sessions.
    os.environ["CPQ_WARM_CALLER"] = "0"
    # The inner pytest runs (pytester) keep their order and seeds: pytest-randomly is
    # installed for the parity tests, which ask for it with -p randomly themselves.
    # Hypothesis's plugin (installed for tests/unit) imports all of hypothesis at start-up:
    # 0.5 of a 0.95 s pytest start, for none of the inner runs' tests.
    addopts = os.environ.get("PYTEST_ADDOPTS", "")
    os.environ["PYTEST_ADDOPTS"] = f"{addopts} -p no:randomly -p no:hypothesispytest".strip()


#: The test files that take longest (``--durations``), run first: with the suite on two xdist
#: workers, a test file each (``tools/test.sh``), one long file left for the end keeps one
#: worker busy alone while the other has nothing left.
LONGEST_FIRST = (
    "test_accelerate.py",
    "test_warm_torchrun.py",
    "test_fidelity.py",
    "fanout/test_slurm.py",
    "test_gpu_leases.py",
    "test_parity_toolbox.py",
    "test_toolbox.py",
    "test_ranks_run_pytest.py",
    "test_plugin.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first, the rest in collection order (every xdist worker computes
    the same order, as xdist asks)."""
    tests = ROOT / "tests"

    def rank(item: pytest.Item) -> int:
        try:
            name = item.path.relative_to(tests).as_posix()
        except ValueError:
            return len(LONGEST_FIRST)
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


def pytest_unconfigure(config: pytest.Config) -> None:
    process = _shared.pop("process", None)
    if process is None:
        return
    for key, value in _shared.pop("old_env").items():  # type: ignore[attr-defined]
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    stop_broker(process)  # type: ignore[arg-type]
    shutil.rmtree(_shared.pop("state"), ignore_errors=True)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def broker_state() -> Path:
    return Path(os.environ["CPQ_STATE_DIR"])


@pytest.fixture(scope="session")
def broker() -> str:
    """The shared broker's endpoint (also CPQ_ENDPOINT, so pytester runs inherit it; an
    xdist worker of this suite finds the controller's there)."""
    return os.environ["CPQ_ENDPOINT"]


@pytest.fixture
def client(broker: str) -> Iterator[Client]:
    with Client(broker, name="pytest") as c:
        yield c


@pytest.fixture
def raw_dealer(broker: str) -> Iterator[zmq.Socket[Any]]:
    """A raw DEALER on the shared broker's frontend: no client library, no hello."""
    context: zmq.Context[Any] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker)
    try:
        yield sock
    finally:
        sock.close(0)
        context.term()


def wait_for_status(
    client: Client, what: str, predicate: Callable[[dict[str, Any]], bool], within: float = 90
) -> dict[str, Any]:
    """Poll the broker's status until ``predicate`` holds; return that status."""
    deadline = time.monotonic() + within
    while True:
        status = client.status()
        if predicate(status):
            return status
        assert time.monotonic() < deadline, f"no {what} after {within:g}s: {status}"
        time.sleep(0.05)


def broker_reply(sock: zmq.Socket[Any], timeout_s: float = 5.0) -> dict[str, Any]:
    """The broker's next answer on a raw socket, skipping its heartbeats."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            message = msgpack.unpackb(sock.recv(), raw=False)
            if message.get("k") != "hb":
                return message
    raise AssertionError(f"no answer from the broker within {timeout_s}s")


def project_session(monkeypatch: pytest.MonkeyPatch, broker: str, project: Path) -> None:
    """A pytester project's runs as a user's shell gives them: this suite's broker, the
    project importable, no ``CPQ_WORLD_SIZE`` of the outer session's."""
    monkeypatch.setenv("CPQ_ENDPOINT", broker)
    monkeypatch.setenv("PYTHONPATH", str(project))
    monkeypatch.delenv("CPQ_WORLD_SIZE", raising=False)


# ---- verdicts test by test, for comparisons with a fresh torchrun -m pytest

#: A pytest plugin (``-p verdicts``, written into a project) recording each pytest
#: process's outcome per test id in ``$VERDICTS_OUT-<RANK, xdist worker or client>.json``
#: (an xdist controller sees every worker's reports: its file is the run's verdicts).
VERDICTS_PLUGIN = """
import json
import os

outcomes = {}


def pytest_runtest_logreport(report):
    now = outcomes.setdefault(report.nodeid, "passed")
    if report.failed:
        outcomes[report.nodeid] = "failed" if report.when == "call" else "error"
    elif report.skipped and now == "passed":
        outcomes[report.nodeid] = "xfailed" if hasattr(report, "wasxfail") else "skipped"


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("VERDICTS_OUT")
    if out:
        env = os.environ
        who = env.get("RANK") or env.get("PYTEST_XDIST_WORKER") or "client"
        with open(f"{out}-{who}.json", "w") as handle:
            json.dump(outcomes, handle)
        with open(f"{out}-{who}.exitstatus", "w") as handle:
            handle.write(str(int(exitstatus)))
"""


def combined_verdicts(per_rank: list[dict[str, str]]) -> dict[str, str]:
    """A fresh torchrun run's verdict per test: its ranks' outcomes combined (failed when
    any rank failed, skipped when every rank skipped)."""
    verdicts = {}
    for nodeid in per_rank[0]:
        seen = {ranks[nodeid] for ranks in per_rank}
        for outcome in ("error", "failed", "passed", "xfailed", "skipped"):
            if outcome in seen:
                verdicts[nodeid] = outcome
                break
    return verdicts


def run_with_verdicts(
    args: list[str], out: Path, cwd: Path, timeout: float = 600, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` in ``cwd`` with the verdicts plugin writing to ``out`` (and ``env``).

    The run is a process of its own, as from a user's shell, not a worker of this suite's
    xdist: this worker's ``PYTEST_XDIST_*`` variables are not passed on (they would name its
    verdicts file), nor this test's ``PYTEST_CURRENT_TEST``."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYTEST_XDIST_") and k != "PYTEST_CURRENT_TEST"
    }
    environ.update(env, VERDICTS_OUT=str(out))
    return subprocess.run(
        args, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout
    )


def fresh_verdicts(
    args: list[str], name: str, cwd: Path, nproc: int = 2, **env: str
) -> tuple[dict[str, str], subprocess.CompletedProcess[str]]:
    """The reference: ``torchrun --standalone --nproc-per-node NPROC -m pytest ARGS`` in
    ``cwd`` (``-p verdicts`` among ``ARGS``; ``env`` set), its ranks' verdicts combined, and
    the run."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run = run_with_verdicts(
        [*torchrun, "--nproc-per-node", str(nproc), "-m", "pytest", *args], cwd / name, cwd, **env
    )
    per_rank = [json.loads((cwd / f"{name}-{r}.json").read_text()) for r in range(nproc)]
    return combined_verdicts(per_rank), run
