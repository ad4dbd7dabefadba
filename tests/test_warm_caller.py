"""A ``--cpq-world-size`` session handed to the project's warm caller (cpq.caller) reports
what a session of its own reports, test by test — against the same session with
``CPQ_WARM_CALLER=0`` — and a variable or an edit that changes what the project's modules
would be is seen. Real processes: the suite's broker, a warm caller the first session
starts, ``python -m pytest`` sessions as a shell starts them.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import psutil
import pytest

from cpq.caller import wire

HEAVY = """
import os
MODE = os.environ.get("HEAVY_MODE", "none")
VALUE = 1
"""

CONFTEST = """
import heavy

SEEN = []

def pytest_collection_modifyitems(items):
    assert not SEEN, "this conftest's module state came from another session"
    SEEN.append(len(items))

def pytest_generate_tests(metafunc):
    if "mode" in metafunc.fixturenames:
        metafunc.parametrize("mode", [heavy.MODE])
"""

TESTS = """
import os, time
import pytest
import heavy

def test_value():
    assert heavy.VALUE == 1

def test_mode(mode):
    assert mode == os.environ.get("HEAVY_MODE", "none")

def test_fails():
    assert heavy.VALUE == 2

@pytest.mark.skip(reason="not today")
def test_skipped():
    pass

def test_waits():
    if not os.environ.get("WAIT_FILE"):
        return
    open(os.environ["WAIT_FILE"] + ".started", "w").close()
    while not os.path.exists(os.environ["WAIT_FILE"]):
        time.sleep(0.05)
"""


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A project whose conftest imports a package of its own; a state directory of its own
    (the warm caller's socket and log), the suite's broker."""
    root = tmp_path / "proj"
    (root / "heavy").mkdir(parents=True)
    (root / "heavy" / "__init__.py").write_text(HEAVY)
    (root / "conftest.py").write_text(CONFTEST)
    (root / "test_things.py").write_text(TESTS)
    (root / "pytest.ini").write_text("[pytest]\n")
    # A short path: a socket's may not exceed 108 bytes, and pytest's tmp_path is deep.
    state = Path(tempfile.mkdtemp(prefix="cpq-wc-"))
    (tmp_path / "state").symlink_to(state)
    yield root
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        if "cpq.caller" in command and str(state) in command:
            process.kill()
    shutil.rmtree(state, ignore_errors=True)


def _env(project: Path, warm: str, **extra: str) -> dict[str, str]:
    state = (project.parent / "state").resolve()
    env = dict(os.environ, CPQ_STATE_DIR=str(state), CPQ_WARM_CALLER=warm)
    env.pop("PYTEST_XDIST_WORKER", None)  # this suite's own, when it runs under xdist
    env.pop("HEAVY_MODE", None)
    env.update(extra)
    return env


#: ``python -m pytest`` as a user types it for a ``--cpq-world-size 1`` session.
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--cpq-world-size", "1"]


def _session(
    project: Path, warm: str, name: str, *args: str, **extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PYTEST, f"--junitxml={project.parent / name}.xml", "-rA", *args],
        cwd=project,
        env=_env(project, warm, **extra),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _verdicts(project: Path, name: str) -> dict[str, str]:
    verdicts = {}
    for case in ET.parse(project.parent / f"{name}.xml").iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        verdicts[case.get("name", "")] = kinds[0] if kinds else "passed"
    return verdicts


def _log(project: Path) -> str:
    return "".join(p.read_text() for p in (project.parent / "state" / "callers").glob("*.log"))


def _served(project: Path) -> int:
    return len(re.findall(r"session \d+ started(?: \(prepared ahead\))?: ", _log(project)))


def _wait_until_served_by_a_warm_caller(project: Path) -> None:
    """The first session started a warm caller: wait until its socket answers."""
    sockets = (project.parent / "state").resolve() / "callers"  # a socket path: 108 bytes
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for path in sockets.glob("*.sock"):
            probe = wire.connect(path, 1.0)
            if probe is not None:
                probe.close()
                return
        time.sleep(0.1)  # polling the socket file the warm caller creates
    raise AssertionError(f"no warm caller came up:\n{_log(project)}")


def _own_then_handed(
    project: Path,
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """A first session starts the warm caller; then one without it and one it serves."""
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    own = _session(project, "0", "own")
    handed = _session(project, "1", "handed")
    assert _served(project) == 1, _log(project)
    return own, handed


def _wait_until_every_warm_caller_serves(project: Path) -> None:
    """Every warm caller started so far has finished importing (it serves, or is gone).

    One a session spawned at its end may not have written a line yet (on a loaded machine
    its interpreter starts seconds later): the session's warming note names it from the
    spawn on, so that note must say it serves, or its process be gone, too."""
    deadline = time.monotonic() + 120
    while True:
        text = _log(project)
        importing = set(re.findall(r"cpq\.caller\[(\d+)\] importing a plan", text))
        done = set(re.findall(r"cpq\.caller\[(\d+)\] (?:serving|giving up|closing)", text))
        if importing <= done and not _spawned_and_warming(project):
            return
        assert time.monotonic() < deadline, text
        time.sleep(0.1)  # polling the warm callers' log and notes


def _spawned_and_warming(project: Path) -> bool:
    """A warming note of the project's state directory names a live warm caller that does
    not serve yet (``wire.still_warming``, what a session itself asks)."""
    state = str((project.parent / "state").resolve())
    with mock.patch.dict(os.environ, {"CPQ_STATE_DIR": state}):
        notes = wire.folder().glob("*.warming.json")
        return any(wire.still_warming(n.name.removesuffix(".warming.json")) for n in notes)


def _same_output(one: str, other: str) -> None:
    def normal(text: str) -> list[str]:
        text = re.sub(r"\d+\.\d+s", "Xs", text).replace("handed.xml", "own.xml")
        text = text.replace("; started from the project's warm caller", "")
        text = re.sub(
            r"; not started from the project's warm caller: .*?(?= -$)", "", text, flags=re.M
        )
        text = re.sub(r"g\d+-\w+", "GROUP", text)
        # The broker's line says what its groups are doing at that moment; the first of
        # two sessions that need a new group says that it waits for it, a few seconds in,
        # where its progress line has begun ("test_things.py " and the notice).
        lines = [
            line
            for line in text.splitlines()
            if not line.startswith(("cpq: broker ", "cpq: waiting for a "))
        ]
        return [
            line
            for line, after in zip(lines, [*lines[1:], ""], strict=True)
            if not (line.endswith(".py ") and after.startswith(line))
        ]

    assert normal(one) == normal(other)


def test_a_handed_over_session_reports_what_its_own_session_reports(project: Path) -> None:
    _session(project, "1", "first")  # runs here, starts the warm caller and the group
    _wait_until_served_by_a_warm_caller(project)
    own = _session(project, "0", "own")
    handed = _session(project, "1", "handed")
    assert _served(project) == 1, _log(project)
    assert (handed.returncode, _verdicts(project, "handed")) == (
        own.returncode,
        _verdicts(project, "own"),
    )
    assert _verdicts(project, "own") == {
        "test_value": "passed",
        "test_mode[none]": "passed",
        "test_fails": "failure",
        "test_skipped": "skipped",
        "test_waits": "passed",
    }
    _same_output(handed.stdout, own.stdout)
    assert handed.stderr == own.stderr
    assert "started from the project's warm caller" in handed.stdout  # as its summary says
    assert "warm caller" not in own.stdout


EXIT_CONFTEST = """
import atexit, gzip, os, sys, threading
import heavy

LOG = open(os.environ["EXIT_LOG"], "w")  # never closed: the exit flushes it
PACKED = gzip.open(os.environ["EXIT_LOG"] + ".gz", "wt")  # never closed either
if os.environ.get("EXIT_HOW") == "message":
    sys.exit("this conftest ends the session")

def pytest_sessionfinish(session):
    LOG.write(f"sessionfinish {session.testsfailed}\\n")
    PACKED.write(f"sessionfinish {session.testsfailed}\\n")

def _late():
    total = 0
    for n in range(3_000_000):  # still running when pytest returns: the exit waits
        total += n
    LOG.write(f"thread {total}\\n")

def pytest_unconfigure(config):
    threading.Thread(target=_late).start()
    if os.environ.get("EXIT_HOW") == "code":
        sys.exit(300)

def pytest_generate_tests(metafunc):
    if "mode" in metafunc.fixturenames:
        metafunc.parametrize("mode", [heavy.MODE])

@atexit.register
def _bye():
    LOG.write("atexit\\n")
    print("atexit says bye")
"""


@pytest.mark.parametrize(("how", "status"), [("status", 1), ("code", 300 & 0xFF), ("message", 1)])
def test_a_handed_over_session_ends_as_its_own_process_ends(
    project: Path, how: str, status: int
) -> None:
    """What a program may rely on at its exit is the same handed over: a non-daemon thread
    still running is waited for, atexit handlers run and print, files left open (a plain
    one, a gzip stream, whose end only its close writes) are complete, the status is
    pytest's or ``sys.exit``'s, a ``sys.exit("why")`` prints and is 1 — with stdout
    buffered, as a shell's pipe has it. (A fork that skipped the interpreter's teardown,
    tried and withdrawn, failed this: docs/design.md, "The warm caller".)"""

    def run(warm: str, name: str, **extra: str) -> subprocess.CompletedProcess[str]:
        env = _env(project, warm, **extra)
        env.pop("PYTHONUNBUFFERED", None)  # a start variable: the same in every session
        return subprocess.run(
            [*PYTEST, f"--junitxml={project.parent / name}.xml", "-rA"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    run("1", "first")
    _wait_until_served_by_a_warm_caller(project)
    (project / "conftest.py").write_text(EXIT_CONFTEST)
    logs = {warm: project.parent / f"exit-{warm}.log" for warm in ("0", "1")}
    runs = {
        warm: run(warm, name, EXIT_LOG=str(logs[warm]), EXIT_HOW=how)
        for warm, name in (("0", "own"), ("1", "handed"))
    }
    assert _served(project) == 1, _log(project)
    own, handed = runs["0"], runs["1"]
    assert handed.returncode == own.returncode == status
    assert logs["1"].read_text() == logs["0"].read_text()
    packed = [gzip.decompress(Path(f"{logs[warm]}.gz").read_bytes()) for warm in ("0", "1")]
    assert packed[0] == packed[1]
    if how == "message":
        assert own.stderr.strip() == handed.stderr.strip() == "this conftest ends the session"
        assert logs["0"].read_text() == "" and own.stdout == handed.stdout == ""
        return
    assert own.stdout.endswith("atexit says bye\n") and handed.stdout.endswith("atexit says bye\n")
    lines = logs["0"].read_text().splitlines()
    assert lines[0].startswith("sessionfinish ") and packed[0] == f"{lines[0]}\n".encode()
    assert lines[1:] == [f"thread {sum(range(3_000_000))}", "atexit"]
    address = re.compile(r"0x[0-9a-f]+")  # sys.exit's traceback names objects
    _same_output(address.sub("0x", handed.stdout), address.sub("0x", own.stdout))


def test_a_variable_the_modules_read_at_import_is_this_sessions(project: Path) -> None:
    _session(project, "1", "first", HEAVY_MODE="a")
    _wait_until_served_by_a_warm_caller(project)
    other = _session(project, "1", "other", HEAVY_MODE="b")
    own = _session(project, "0", "own", HEAVY_MODE="b")
    assert _verdicts(project, "other") == _verdicts(project, "own")
    assert _verdicts(project, "other")["test_mode[b]"] == "passed"
    assert other.returncode == own.returncode == 1
    assert "its imports read HEAVY_MODE, which differs" in _log(project)


def test_an_edit_after_the_warm_caller_imported_is_seen(project: Path) -> None:
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    module = project / "heavy" / "__init__.py"
    module.write_text(HEAVY.replace("VALUE = 1", "VALUE = 2"))
    later = time.time_ns() + 2_000_000_000
    os.utime(module, ns=(later, later))  # a later stamp even on a coarse clock
    edited = _session(project, "1", "edited")
    own = _session(project, "0", "own")
    assert _served(project) >= 1, _log(project)
    assert _verdicts(project, "edited") == _verdicts(project, "own")
    assert _verdicts(project, "edited")["test_fails"] == "passed"
    assert edited.returncode == own.returncode


def _interrupted(
    project: Path, warm: str, how: signal.Signals, release: bool = True
) -> tuple[int, str, int]:
    """A session whose test waits; ``how`` sent to the process the shell started once the
    test runs. Returns the exit status, the output and the pid of the process that ran it."""
    wait_file = project.parent / f"wait-{warm}-{how.name}"
    started = time.monotonic()
    process = subprocess.Popen(
        [*PYTEST, "-k", "waits"],
        cwd=project,
        env=_env(project, warm, WAIT_FILE=str(wait_file)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's
    )
    while not Path(f"{wait_file}.started").exists():
        assert process.poll() is None and time.monotonic() - started < 120, process.stdout
        time.sleep(0.05)  # polling the file the test writes once it runs
    runner = _session_process(project, process.pid)
    process.send_signal(how)
    out, _ = process.communicate(timeout=120)
    if release:
        wait_file.touch()  # whatever is left of the test ends
    return process.returncode, out, runner


def _session_process(project: Path, caller: int) -> int:
    """The pid that runs the session: the warm caller's fork, else the caller itself."""
    found = re.findall(r"session (\d+) started: ", _log(project))
    return int(found[-1]) if found else caller


def test_an_interrupt_ends_a_handed_over_session_as_it_ends_its_own(project: Path) -> None:
    own_status, own_out, _ = _interrupted(project, "0", signal.SIGINT)
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    status, out, _runner = _interrupted(project, "1", signal.SIGINT)
    assert _served(project) == 1, _log(project)
    assert status == own_status == 2
    assert "KeyboardInterrupt" in out and "KeyboardInterrupt" in own_out


def test_killing_the_caller_kills_the_session_it_handed_over(project: Path) -> None:
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    status, _, runner = _interrupted(project, "1", signal.SIGKILL, release=False)
    assert status == -signal.SIGKILL
    assert _served(project) == 1, _log(project)
    # The test still waits for its file: only the warm caller's kill can have ended it.
    deadline = time.monotonic() + 60
    while f"session {runner} ended: wait status {int(signal.SIGKILL)}" not in _log(project):
        assert time.monotonic() < deadline, _log(project)
        time.sleep(0.1)  # polling the warm caller's log
    assert f"session {runner}: its caller is gone" in _log(project)
    assert not psutil.pid_exists(runner) or psutil.Process(runner).status() == "zombie"
    (project.parent / "wait-1-SIGKILL").touch()  # the ranks' side of the test ends


def test_a_session_that_comes_while_the_warm_caller_warms_waits_for_it(project: Path) -> None:
    """``pytest`` right after ``pytest``: the first session's warm caller is still importing
    (a 4 s import) when the second session starts. It expects to serve before the session
    would have started by itself, so the session waits for it and is handed over."""
    heavy = project / "heavy" / "__init__.py"
    heavy.write_text("import time\ntime.sleep(4)\n" + heavy.read_text())
    _session(project, "0", "zero")  # the group is up: the next session ends at once
    _session(project, "1", "first")  # starts its warm caller at its start, 4 s of import
    handed = _session(project, "1", "handed")
    assert _served(project) == 1, _log(project)
    own = _session(project, "0", "own")
    assert (handed.returncode, _verdicts(project, "handed")) == (
        own.returncode,
        _verdicts(project, "own"),
    )


SPINNER = """
import threading, time
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
STARTED = True
"""


def test_a_module_whose_import_starts_a_thread_is_left_to_the_session_with_its_users(
    project: Path,
) -> None:
    """A fork copies one thread: a module whose code starts one is left out of the warm
    caller, and so is every module that needs it (here two: the second imports it when it
    is loaded already). One pass finds them all, so the warm caller starts again once; the
    session imports them itself."""
    (project / "spinner.py").write_text(SPINNER)
    (project / "spins.py").write_text("import spinner\n")
    (project / "spins_too.py").write_text("from spinner import STARTED\n")
    conftest = project / "conftest.py"
    conftest.write_text("import spins, spins_too\n" + conftest.read_text())
    own, handed = _own_then_handed(project)
    log_text = _log(project)
    assert "leaving out spinner: its code started a thread, and 2 modules" in log_text, log_text
    assert log_text.count("starting again") == 1, log_text
    assert (handed.returncode, _verdicts(project, "handed")) == (
        own.returncode,
        _verdicts(project, "own"),
    )


def test_an_xdist_session_is_handed_over_and_keeps_the_projects_warm_caller(
    project: Path,
) -> None:
    """The xdist controller is the process the shell started: it is handed over (its workers
    are its own children, started by the fork), and the fork plans under the same key (an
    ini's ``pythonpath`` is on ``sys.path`` by the time the fork's plugin asks)."""
    (project / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    own = _session(project, "0", "own", "-n", "2")
    handed = _session(project, "1", "handed", "-n", "2")
    assert _served(project) == 1, _log(project)
    assert (handed.returncode, _verdicts(project, "handed")) == (
        own.returncode,
        _verdicts(project, "own"),
    )
    plans = list((project.parent / "state").resolve().glob("callers/*.plan.json"))
    assert len(plans) == 1, plans


RECORDS_TO_THE_CALLERS_DESCRIPTOR = """
import os

def _callers_descriptor() -> int:
    # The descriptor the shell passed (CALLER_FD): in the calling process only; a rank's
    # descriptor of that number, if any, is another file.
    try:
        fd = int(os.environ["CALLER_FD"])
        return fd if os.fstat(fd).st_ino == int(os.environ["CALLER_FD_INO"]) else -1
    except (KeyError, ValueError, OSError):
        return -1

_fd = _callers_descriptor()
if _fd >= 0:
    _first = os.open(os.devnull, os.O_RDONLY)  # the lowest free number, as in a fresh process
    os.close(_first)
    os.write(_fd, f"the caller's descriptor {_fd}; first free {_first}\\n".encode())
"""


def test_a_descriptor_the_shell_passed_is_the_handed_over_sessions_at_its_number(
    project: Path,
) -> None:
    """``pytest 7>file`` (``make``'s jobserver, a shell's ``/dev/fd/63``): the fork has the
    caller's descriptor at its number, and the numbers below it that the caller has free are
    free in the fork too — what a conftest of each session writes there is the same."""
    conftest = project / "conftest.py"
    conftest.write_text(RECORDS_TO_THE_CALLERS_DESCRIPTOR + conftest.read_text())
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    written = {}
    for warm in ("0", "1"):
        record = project.parent / f"passed-{warm}.txt"
        with open(record, "wb") as out:
            fd = os.dup(out.fileno())
            try:
                done = subprocess.run(
                    [*PYTEST, f"--junitxml={project.parent / warm}.xml"],
                    cwd=project,
                    env=_env(
                        project,
                        warm,
                        CALLER_FD=str(fd),
                        CALLER_FD_INO=str(os.fstat(fd).st_ino),
                    ),
                    pass_fds=(fd,),
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
            finally:
                os.close(fd)
        written[warm] = (done.returncode, _verdicts(project, warm), record.read_text())
    assert _served(project) == 1, _log(project)
    assert written["1"] == written["0"]
    assert written["0"][2].startswith("the caller's descriptor "), written


def test_a_variable_an_import_sets_is_set_in_the_handed_over_session_too(
    project: Path,
) -> None:
    """``torch.compile``'s shape: an import sets a variable where it is unset. The warm
    caller keeps the module (it is not left out) and sets the variable in each session
    it hands over, as the import would have; a session that has the variable already —
    where the import would not have set it — is not handed over."""
    (project / "cache_default.py").write_text(
        "import os\nos.environ.setdefault('HEAVY_CACHE', '/tmp/heavy-cache')\n"
    )
    conftest = project / "conftest.py"
    conftest.write_text(
        "import os, cache_default\n\n"
        "def pytest_report_header():\n"
        "    return f\"heavy cache: {os.environ.get('HEAVY_CACHE')}\"\n\n" + conftest.read_text()
    )
    own, handed = _own_then_handed(project)
    assert "leaving out" not in _log(project)
    assert "heavy cache: /tmp/heavy-cache" in own.stdout
    _same_output(handed.stdout, own.stdout)
    other = _session(project, "1", "other", HEAVY_CACHE="/other")
    own_other = _session(project, "0", "own_other", HEAVY_CACHE="/other")
    assert "its imports set HEAVY_CACHE, which this session has otherwise" in _log(project)
    assert (  # and the session says why it started by itself
        "not started from the project's warm caller: its imports set HEAVY_CACHE" in other.stdout
    )
    assert "heavy cache: /other" in own_other.stdout
    _same_output(
        other.stdout.replace("other.xml", "own.xml"),
        own_other.stdout.replace("own_other.xml", "own.xml"),
    )


def test_an_entry_an_import_appends_to_the_path_is_appended_in_the_handed_over_session_too(
    project: Path,
) -> None:
    """setuptools' shape: its import appends its ``_vendor`` folder to ``sys.path`` and
    imports from it. The warm caller keeps the module (it is not left out) and appends the
    entry in each session it hands over when the session imports the module, as the
    import would have."""
    (project / "vendor").mkdir()
    (project / "vendor" / "vendored_dep.py").write_text("NAME = 'vendored'\n")
    (project / "appends.py").write_text(
        "import os, sys\n"
        "here = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'vendor')\n"
        "sys.path.extend([here] if here not in sys.path else [])\n"
        "import vendored_dep\n"
    )
    conftest = project / "conftest.py"
    conftest.write_text(
        "import sys, appends\n\n"
        "def pytest_report_header():\n"
        "    tail = [p.rpartition('/')[2] for p in sys.path[-2:]]\n"
        "    return f'{appends.vendored_dep.NAME}; the path ends {tail}'\n\n" + conftest.read_text()
    )
    own, handed = _own_then_handed(project)
    assert "leaving out" not in _log(project)
    assert "vendored; the path ends" in own.stdout and "'vendor']" in own.stdout
    _same_output(handed.stdout, own.stdout)


def test_what_the_import_of_a_module_that_stays_loaded_warned_is_warned_in_the_session(
    project: Path,
) -> None:
    """Megatron-LM's shape: a module that registers a torch operator cannot leave the warm
    caller's ``sys.modules`` (a second import would register it again), so a handed-over
    session finds it loaded; what its import warned is warned in the session all the same,
    where the conftest's import would have warned it."""
    (project / "registers.py").write_text(
        "import warnings, torch\n"
        "warnings.warn('falling back to the slow kernels', UserWarning)\n"
        "@torch.library.custom_op('cpqwarmcaller::twice', mutates_args=())\n"
        "def twice(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x * 2\n"
    )
    conftest = project / "conftest.py"
    conftest.write_text("import registers\n" + conftest.read_text())
    own, handed = _own_then_handed(project)
    assert "falling back to the slow kernels" in own.stdout
    _same_output(handed.stdout, own.stdout)


def test_a_cd_elsewhere_and_back_keeps_the_warm_caller(project: Path) -> None:
    """tqdm's shape (torch imports it): a module walks the whole environment at import for
    the variables of its prefix. A session typed after a ``cd`` elsewhere and back (another
    ``OLDPWD``), or from a script (another ``SHLVL``), or with a variable of its own that
    the walk passes over, is handed over all the same; one of the walk's prefix is not."""
    (project / "walks.py").write_text(
        "import os\nFOUND = {k: v for k, v in os.environ.items() if k.startswith('WALK_')}\n"
    )
    conftest = project / "conftest.py"
    conftest.write_text("import walks\n" + conftest.read_text())
    _session(project, "1", "first", OLDPWD="/here", SHLVL="1", WALK_MODE="a", OTHER_FLAG="0")
    _wait_until_served_by_a_warm_caller(project)
    elsewhere = _session(project, "1", "elsewhere", OLDPWD="/elsewhere", SHLVL="2", WALK_MODE="a")
    assert _served(project) == 1, _log(project)
    own = _session(project, "0", "own", OLDPWD="/elsewhere", SHLVL="2", WALK_MODE="a")
    assert (elsewhere.returncode, _verdicts(project, "elsewhere")) == (
        own.returncode,
        _verdicts(project, "own"),
    )
    _session(project, "1", "unrelated", OLDPWD="/elsewhere", WALK_MODE="a", OTHER_FLAG="1")
    assert _served(project) == 2, _log(project)
    _session(project, "1", "walked", OLDPWD="/elsewhere", WALK_MODE="b")
    assert _served(project) == 2, _log(project)
    assert "its imports read WALK_MODE, which differs" in _log(project)


def test_after_an_edit_the_next_warm_caller_holds_the_edited_module(project: Path) -> None:
    """A handed-over session whose modules held aside were stale (a file edited since the
    warm caller imported it) imports them itself, and plans a new warm caller at its end:
    the sessions after it are not each left to import them again."""
    heavy = project / "heavy" / "__init__.py"
    imports = project.parent / "heavy-imports.txt"  # the pid of each process importing it
    recording = f"import os\nopen({str(imports)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
    heavy.write_text(recording + HEAVY)
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    _session(project, "1", "second")
    _wait_until_every_warm_caller_serves(project)  # none imports heavy after the edit
    heavy.write_text(recording + HEAVY.replace("VALUE = 1", "VALUE = 2"))
    later = time.time_ns() + 2_000_000_000
    os.utime(heavy, ns=(later, later))  # a later stamp even on a coarse clock
    _session(project, "1", "edited")
    assert _served(project) == 2, _log(project)
    # The session spawned the new warm caller at its end: that process writes why it was
    # planned once its interpreter starts, which on a loaded machine is after the session
    # has returned. Its warming note names it from the spawn on: wait until it serves.
    _wait_until_every_warm_caller_serves(project)
    assert "planned because what the warm caller held aside was stale" in _log(project)
    again = _session(project, "1", "again")
    assert _served(project) == 3, _log(project)
    assert _verdicts(project, "again")["test_fails"] == "passed"
    assert again.returncode == 1  # test_value fails now
    fork = _session_process(project, -1)
    assert str(fork) not in imports.read_text().split(), "the session imported heavy itself"


def test_cpq_stop_ends_the_warm_caller_as_it_ends_the_broker(project: Path) -> None:
    """``cpq stop`` stops what cpq runs for this state directory: the warm caller takes no
    more sessions and exits (once the sessions it runs are done)."""
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    state = str((project.parent / "state").resolve())
    callers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "cpq.caller" in " ".join(p.info["cmdline"] or ())
        and state in " ".join(p.info["cmdline"] or ())
    ]
    assert callers, _log(project)
    env = _env(project, "1")
    env.pop("CPQ_ENDPOINT")  # the state directory's own broker (none): not this suite's
    stopped = subprocess.run(
        [sys.executable, "-m", "cpq", "stop"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "warm caller(s) take no more sessions" in stopped.stdout, stopped.stdout
    _, alive = psutil.wait_procs(callers, timeout=60)
    assert not alive, _log(project)
    assert "its socket was removed (cpq stop)" in _log(project)
