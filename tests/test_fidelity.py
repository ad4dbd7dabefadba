"""Fidelity: a warm group gives the verdict a fresh run would (docs/design.md, "Fidelity").

Every test here is a difference: a user's own project (written to ``tmp_path``, not cpq's
tests) is run as separate pytest sessions on one warm broker, something changes between
the sessions (a helper module, an installed package, the shell's environment), and the
verdicts through cpq must equal the verdicts of a plain run of the same files
(``-p no:cpq``: the body runs in the pytest process itself, freshly started).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, start_broker, wait_for_status

from cpq import Client
from cpq.client.autostart import stop_broker

CLEAN_PREFIXES = ("PYTEST_", "CPQ_", "MYPROJ_")


def session_env(endpoint: str, **extra: str) -> dict[str, str]:
    """The environment of a user's shell: this one, less pytest's and cpq's own variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN_PREFIXES)}
    env.update(CPQ_ENDPOINT=endpoint, CPQ_AUTOSTART="0", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def run_pytest(
    project: Path, env: dict[str, str], *args: str, plain: bool = False, timeout: float = 240
) -> tuple[dict[str, str], str]:
    """One pytest session in ``project``: ``({test name: outcome}, output)``."""
    junit = project / f"junit-{time.monotonic_ns()}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += [] if any(a.endswith("randomly") for a in args) else ["-p", "no:randomly"]
    command += ["-p", "no:cpq"] if plain else []
    command += [f"--junitxml={junit}", *args]
    done = subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=timeout
    )
    output = done.stdout + done.stderr
    assert junit.exists(), output
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "passed"
        outcomes[case.get("name", "")] = "skipped" if "skipped" in kinds else outcome
    junit.unlink()
    return outcomes, output


def same_verdicts(project: Path, env: dict[str, str], *args: str) -> dict[str, str]:
    """Run through cpq and plainly; assert the verdicts agree; return them."""
    through_cpq, cpq_output = run_pytest(project, env, *args)
    plain, plain_output = run_pytest(project, env, *args, plain=True)
    assert through_cpq == plain, f"cpq:\n{cpq_output}\nplain:\n{plain_output}"
    return through_cpq


def write(path: Path, text: str) -> None:
    """Write a source file so that its stamp changes even within one clock tick."""
    path.parent.mkdir(parents=True, exist_ok=True)
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(textwrap.dedent(text))
    if path.stat().st_mtime_ns <= before:  # a coarse file system clock: move it forward
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


@pytest.fixture(scope="module")
def warm_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private broker for this module, started with a variable no task may see."""
    state = tmp_path_factory.mktemp("fidelity-state")
    os.environ["MYPROJ_BROKER_ONLY"] = "leaked"
    try:
        process, endpoint = start_broker(
            state, "--max-ranks", "6", "--spares", "0"
        )  # spares: test_spares
    finally:
        del os.environ["MYPROJ_BROKER_ONLY"]
    yield endpoint
    stop_broker(process)


# --------------------------------------------------------------------------- code


def test_an_edited_helper_module_changes_the_verdict(warm_broker: str, tmp_path: Path) -> None:
    """Helpers imported directly, indirectly, as a package ``__init__``, and only at
    collection: after each edit the next session's verdicts follow the code on disk."""
    write(tmp_path / "mylib.py", "from deep import base\ndef answer():\n    return base() + 1\n")
    write(tmp_path / "deep.py", "def base():\n    return 40\n")
    write(tmp_path / "pkg/__init__.py", "VALUE = 'old'\n")
    write(tmp_path / "settings.py", "N = 1\n")
    write(
        tmp_path / "conftest.py",
        """
        import pytest
        from settings import N

        @pytest.fixture
        def n():
            return N
        """,
    )
    write(
        tmp_path / "test_lib.py",
        """
        import pytest
        from mylib import answer
        import pkg

        @pytest.mark.cpq(world_size=2)
        def test_answer():
            assert answer() == 42

        @pytest.mark.cpq(world_size=2)
        def test_package():
            assert pkg.VALUE == "new"

        @pytest.mark.cpq(world_size=2)
        def test_collected_value(n):
            assert n == 2
        """,
    )
    env = session_env(warm_broker)
    first = same_verdicts(tmp_path, env)
    assert first == dict.fromkeys(["test_answer", "test_package", "test_collected_value"], "failed")

    write(tmp_path / "deep.py", "def base():\n    return 41\n")  # imported only by mylib
    write(tmp_path / "pkg/__init__.py", "VALUE = 'new'\n")
    write(tmp_path / "settings.py", "N = 2\n")
    second = same_verdicts(tmp_path, env)
    assert set(second.values()) == {"passed"}

    write(tmp_path / "mylib.py", "def answer():\n    return 41\n")  # and back to failing
    third = same_verdicts(tmp_path, env)
    assert third["test_answer"] == "failed"


def test_the_code_check_holds_on_every_warm_group(warm_broker: str, tmp_path: Path) -> None:
    """Two warm groups loaded the helper; after an edit, neither runs the old code (before,
    the verdict depended on which group was free)."""
    write(tmp_path / "mylib.py", "def answer():\n    return 41\n")
    write(
        tmp_path / "test_lib.py",
        """
        import pytest
        from mylib import answer

        @pytest.mark.cpq(world_size=1)
        @pytest.mark.parametrize("i", range(6))
        def test_answer(i):
            assert answer() == 41
        """,
    )
    env = session_env(warm_broker)
    pytest.importorskip("xdist")
    assert set(run_pytest(tmp_path, env, "-n", "2")[0].values()) == {"passed"}
    write(tmp_path / "mylib.py", "def answer():\n    return 42\n")
    for _ in range(2):  # any group, any order: always the new code
        assert set(run_pytest(tmp_path, env, "-n", "2")[0].values()) == {"failed"}


JIT = """
import importlib.util
import os
import sys


def load():
    \"\"\"What Triton and TorchInductor do: write a generated module into a cache directory
    unless it is there (its name is a hash of its source), then import it.\"\"\"
    name = "generated_kernel_" + os.environ["MYPROJ_JIT_NAME"]
    path = os.path.join(os.environ["MYPROJ_JIT_DIR"], name + ".py")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as out:
            out.write("VALUE = 42\\n")
        os.replace(path + ".tmp", path)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].VALUE
"""


def test_generated_code_in_a_compiler_cache_keeps_the_group_warm(
    warm_broker: str, tmp_path: Path
) -> None:
    """A kernel compiled during a test lands in the compiler's cache: the group stays warm
    (seen on GPUs: every group that compiled a Triton kernel was stopped). The same module
    written into the project is code that changed while it was loaded: inside the session
    that wrote it, the group goes on (a fresh pytest process reads no edit after its imports
    either); the session's end forgets it, and the next session imports it afresh on the
    same group (no fresh group: it is no longer the group's code)."""
    write(tmp_path / "jit.py", JIT)
    write(
        tmp_path / "test_jit.py",
        """
        import pytest
        from jit import load

        @pytest.mark.cpq(world_size=1, env={"MYPROJ_RUN": "jit"})
        @pytest.mark.parametrize("i", range(2))
        def test_kernel(i):
            assert load() == 42
        """,
    )
    groups = {}
    for where in ("cache", "project"):
        env = session_env(warm_broker, MYPROJ_JIT_NAME=where)
        env["MYPROJ_JIT_DIR"] = str(tmp_path / where / "kernels")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "cache")
        outcomes, output = run_pytest(tmp_path, env)  # the kernel is compiled in the first test
        assert set(outcomes.values()) == {"passed"}, output
        match = re.search(r"cpq: 2 task\(s\) on (\d+) group\(s\)", output)
        assert match is not None, output
        groups[where] = int(match.group(1))
    # The difference a fresh run would show: none (a plain session passes as well).
    assert set(run_pytest(tmp_path, env, plain=True)[0].values()) == {"passed"}
    assert groups == {"cache": 1, "project": 1}, groups
    with Client(warm_broker) as client:
        started = client.status()["totals"]["groups_started"]
    outcomes, output = run_pytest(tmp_path, env)  # the project's module, imported afresh
    assert set(outcomes.values()) == {"passed"}, output
    with Client(warm_broker) as client:
        assert client.status()["totals"]["groups_started"] == started, output


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A virtual environment on top of this one, for installing packages into."""
    target = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(target)],
        check=True,
        timeout=120,
    )
    # --system-site-packages reaches the base interpreter's packages, not this environment's
    # when it is a venv itself (where cpq, torch and pyzmq may be installed): add its site
    # directories, .pth files included (an editable cpq is one).
    site = next((target / "lib").glob("python*/site-packages"))
    parents = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    lines = [f"import site; site.addsitedir({p!r})" for p in parents]
    (site / "_cpq_test_parent.pth").write_text("\n".join(lines) + "\n")
    return target


def pip_install(venv: Path, *args: str) -> None:
    site = next((venv / "lib").glob("python*/site-packages"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip, "--no-index", "--prefix", str(venv), *args],
        check=True,
        timeout=240,
        capture_output=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert site.exists()


def make_dist(path: Path, name: str, version: str, value: str) -> Path:
    write(
        path / "pyproject.toml",
        f"""
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "{version}"
        """,
    )
    write(path / name / "__init__.py", f"VALUE = {value!r}\n")
    return path


def test_installed_and_editable_packages_count_as_code(
    warm_broker: str, tmp_path: Path, venv: Path
) -> None:
    """An upgrade of an installed package, and an edit of an editable one, reach the ranks."""
    project = tmp_path / "project"
    write(
        project / "test_dep.py",
        """
        import os
        import pytest

        @pytest.mark.cpq(world_size=1)
        def test_value():
            module = __import__(os.environ["MYPROJ_MODULE"])
            assert module.VALUE == os.environ["MYPROJ_EXPECT"]
        """,
    )
    python = str(venv / "bin" / "python")
    env = session_env(warm_broker, VIRTUAL_ENV=str(venv))
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"

    def verdict(module: str, expect: str) -> str:
        env.update(MYPROJ_MODULE=module, MYPROJ_EXPECT=expect)
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        runs = [
            subprocess.run(
                command + extra, cwd=project, env=env, capture_output=True, text=True, timeout=240
            )
            for extra in ([], ["-p", "no:cpq"])
        ]
        assert runs[0].returncode == runs[1].returncode, runs[0].stdout + runs[1].stdout
        return "passed" if runs[0].returncode == 0 else "failed"

    pip_install(venv, str(make_dist(tmp_path / "v1", "cpqfixdep", "1.0", "one")))
    assert verdict("cpqfixdep", "one") == "passed"
    pip_install(venv, str(make_dist(tmp_path / "v2", "cpqfixdep", "2.0", "two")))  # upgrade
    assert verdict("cpqfixdep", "two") == "passed"
    assert verdict("cpqfixdep", "one") == "failed"

    editable = make_dist(tmp_path / "editable", "cpqfixedit", "1.0", "three")
    pip_install(venv, "-e", str(editable))
    assert verdict("cpqfixedit", "three") == "passed"
    write(editable / "cpqfixedit/__init__.py", "VALUE = 'edited'\n")  # no reinstall
    assert verdict("cpqfixedit", "edited") == "passed"


# --------------------------------------------------------------------------- environment


ENV_SUITE = """
import os
import pytest
import torch

@pytest.mark.cpq(world_size=2)
def test_flag_is_on():
    assert os.environ.get("MYPROJ_FLAG") == "on"

@pytest.mark.cpq(world_size=2)
def test_gone_is_unset():
    assert "MYPROJ_GONE" not in os.environ

@pytest.mark.cpq(world_size=2)
def test_broker_env_stays_home():
    assert "MYPROJ_BROKER_ONLY" not in os.environ

@pytest.mark.cpq(world_size=2)
def test_threads_follow_omp():
    assert torch.get_num_threads() == int(os.environ.get("MYPROJ_THREADS", "1"))
"""


def test_tasks_see_exactly_the_callers_environment(warm_broker: str, tmp_path: Path) -> None:
    write(tmp_path / "test_env.py", ENV_SUITE)
    names = ["test_flag_is_on", "test_gone_is_unset", "test_broker_env_stays_home"]
    on = session_env(warm_broker, MYPROJ_FLAG="on", OMP_NUM_THREADS="1")
    changed = session_env(warm_broker, MYPROJ_FLAG="off", MYPROJ_GONE="1", OMP_NUM_THREADS="1")
    unset = session_env(warm_broker, OMP_NUM_THREADS="1")
    expected = [["passed"] * 3, ["failed", "failed", "passed"], ["failed", "passed", "passed"]]
    for env, verdicts in zip((on, changed, unset), expected, strict=True):
        seen = same_verdicts(tmp_path, env)  # one session each way per environment
        assert [seen[n] for n in names] == verdicts


def test_a_start_variable_gets_a_group_of_its_own(warm_broker: str, tmp_path: Path) -> None:
    write(tmp_path / "test_env.py", ENV_SUITE)
    for threads in ("1", "2"):
        env = session_env(warm_broker, OMP_NUM_THREADS=threads, MYPROJ_THREADS=threads)
        verdicts = same_verdicts(tmp_path, env, "-k", "threads")
        assert verdicts == {"test_threads_follow_omp": "passed"}
    with Client(warm_broker) as client:
        pools = client.status()["pools"]
    omp = {p["id"]: p["env"].get("OMP_NUM_THREADS") for p in pools if p["world_size"] == 2}
    assert {"1", "2"} <= set(omp.values()), pools


# --------------------------------------------------------------------------- abandoned


LONG_SUITE = """
import os, time
import pytest

@pytest.mark.cpq(world_size=2)
def test_long():
    open(os.environ["MYPROJ_STARTED"], "a").close()
    time.sleep(120)

@pytest.mark.cpq(world_size=2)
def test_quick():
    pass
"""


def test_ctrl_c_frees_the_group_and_the_next_session_does_not_wait(
    warm_broker: str, tmp_path: Path
) -> None:
    write(tmp_path / "test_long.py", LONG_SUITE)
    started = tmp_path / "started"
    env = session_env(warm_broker, MYPROJ_STARTED=str(started))
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "long"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not started.exists():
        assert session.poll() is None, session.communicate()[0]
        assert time.monotonic() < deadline, "the long test never started"
        time.sleep(0.05)
    with Client(warm_broker) as client:
        interrupted = time.monotonic()
        session.send_signal(signal.SIGINT)  # Ctrl-C
        # README: a client that goes away has its running tasks interrupted within ~3 s
        wait_for_status(
            client,
            "no busy group",
            lambda s: not any(p["state"] == "busy" for p in s["pools"]),
            within=60,
        )
        freed_after = time.monotonic() - interrupted
    session.communicate(timeout=60)
    assert freed_after < 3.5, f"the group was busy {freed_after:.1f}s after Ctrl-C"
    verdicts, output = run_pytest(tmp_path, env, "-k", "quick")
    assert verdicts == {"test_quick": "passed"}, output
    assert "cpq: waiting for a" not in output  # no notice: the group was free at once


# --------------------------------------------------------------------------- reports


STEPS_SUITE = """
import os, time
import pytest

@pytest.mark.cpq(world_size=1)
@pytest.mark.parametrize("i", range(6))
def test_step(i):
    if i == 1:
        open(os.environ["MYPROJ_STARTED"], "a").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.environ["MYPROJ_GO"]) and time.monotonic() < deadline:
            time.sleep(0.05)
"""


def broker_goes_mid_session(tmp_path: Path, how: str) -> str:
    """Run a 6-test session; when test 1 runs, end its broker ``how``; return the output."""
    state = tmp_path / "state"
    broker, endpoint = start_broker(state)
    project = tmp_path / "project"
    write(project / "test_steps.py", STEPS_SUITE)
    started, go = tmp_path / "started", tmp_path / "go"
    env = session_env(endpoint, MYPROJ_STARTED=str(started), MYPROJ_GO=str(go))
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not started.exists():
        assert session.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    if how == "kill":
        broker.kill()
        broker.wait()
    else:
        drain = subprocess.Popen(
            [sys.executable, "-m", "cpq", "drain"], env=session_env(endpoint), cwd=project
        )
        with Client(endpoint) as client:
            wait_for_status(client, "draining", lambda s: s["broker"]["draining"], within=30)
        go.touch()
        drain.wait(timeout=60)
    go.touch()
    output, _ = session.communicate(timeout=120)
    stop_broker(broker)
    return output


@pytest.mark.parametrize("how", ["kill", "drain"])
def test_a_broker_that_goes_fails_the_rest_in_one_line_each(tmp_path: Path, how: str) -> None:
    output = broker_goes_mid_session(tmp_path, how)
    # Each failure's report is the lines between its "____ test_step[i] ____" header and
    # the next header (or the summary).
    reports: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        header = re.fullmatch(r"_+ (test_step\[\d\]) _+", line)
        if header:
            current = reports.setdefault(header.group(1), [])
        elif re.fullmatch(r"[-=]+( .* [-=]+)?", line):  # a separator, say cpq's summary
            current = None
        elif current is not None and line.strip():
            current.append(line)
    # kill: the running test and the 4 after it; drain: the running test still passes
    assert len(reports) == (5 if how == "kill" else 4), output
    expected = "stopped answering" if how == "kill" else "drain"
    for lines in reports.values():
        assert len(lines) == 1 and expected in lines[0], output
    assert "Traceback" not in output and "client.py" not in output, output


HANG_SUITE = """
import time
import pytest
import torch.distributed as dist

def wait_forever():
    while True:
        time.sleep(0.1)

@pytest.mark.cpq(world_size=2, timeout=3)
def test_hangs_on_rank_1():
    if dist.get_rank() == 1:
        wait_forever()
"""


def test_a_hang_shows_each_ranks_stack_once_without_cpq_frames(
    warm_broker: str, tmp_path: Path
) -> None:
    write(tmp_path / "test_hang.py", HANG_SUITE)
    verdicts, output = run_pytest(tmp_path, session_env(warm_broker))
    assert verdicts == {"test_hangs_on_rank_1": "failed"}, output
    assert output.count("in wait_forever") == 1, output  # rank 1's stack, once
    assert "cpq/rank/" not in output and "queue.py" not in output, output
    assert "[CPQ-RETRY-FAIL]" in output, output


# --------------------------------------------------------------------------- history


def test_two_projects_with_one_test_id_keep_separate_timings(
    warm_broker: str, tmp_path: Path
) -> None:
    for name, seconds in (("one", 0.0), ("two", 1.0)):
        write(
            tmp_path / name / "test_dist.py",
            f"""
            import time
            import pytest

            @pytest.mark.cpq(world_size=1)
            def test_all_reduce():
                time.sleep({seconds})
            """,
        )
        verdicts, output = run_pytest(tmp_path / name, session_env(warm_broker))
        assert verdicts == {"test_all_reduce": "passed"}, output
    state = Path(warm_broker.removeprefix("ipc://")).parent
    timings = subprocess.run(
        [sys.executable, "-m", "cpq", "status", "--timings", "--json"],
        env={**session_env(warm_broker), "CPQ_STATE_DIR": str(state)},
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    rows = [t for t in json.loads(timings.stdout)["tests"] if t["test"].endswith("test_all_reduce")]
    assert len(rows) == 2, rows
    assert {Path(r["project"]).name for r in rows} == {"one", "two"}
