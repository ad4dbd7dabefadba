"""accelerate as its own test suite uses it, under ``pytest --cpq-torchrun``, with no user
hook: its distributed test scripts launched per test the way accelerate's tests launch them
(``execute_subprocess_async(["torchrun", "--nproc-per-node", "2", script])``, CPU, gloo,
``ACCELERATE_USE_CPU=true``) and ``accelerate launch`` (in process through
``launch_command``, and as a subprocess) give the verdicts they give without cpq, cold and
warm, on warm groups. accelerate is pinned in the test extras (pyproject.toml).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpq import Client

pytest.importorskip("accelerate")

SCRIPTS = [
    "test_script",
    "test_sync",
    "test_ops",
    "test_cli",
    "test_ddp_comm_hook",
    "test_merge_weights",
]

SUITE = """
import os
import random
import socket
import subprocess
import sys

import pytest
from accelerate.test_utils import execute_subprocess_async, path_in_accelerate_package

SCRIPTS = {scripts!r}


def port():
    # a free port for each launch: the plain run's torchrun shares this host with the
    # suite's other worker (the default 29500 collided under xdist); cpq routes any port.
    # It is drawn below the kernel's ephemeral range: a port from bind(0) is free only
    # until the next outgoing connection takes it as its local port, and the plain
    # torchrun binds it seconds later (a plain run failed so, once in CI)
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for candidate in random.sample(range(low // 2, low), 64):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return str(candidate)
    raise RuntimeError("no free port below the ephemeral range")


@pytest.mark.parametrize("name", SCRIPTS)
def test_accelerate_script(name):
    script = path_in_accelerate_package("test_utils", "scripts", f"{{name}}.py")
    cmd = ["torchrun", "--nproc-per-node", "2", "--master-port", port(), str(script)]
    execute_subprocess_async(cmd, env=os.environ.copy())


def test_fails_on_rank_one_while_rank_zero_waits():
    cmd = ["torchrun", "--nproc-per-node", "2", "--master-port", port(), "fail_rank1.py"]
    execute_subprocess_async(cmd, env=os.environ.copy())


def test_launch_command_in_process():
    from accelerate.commands.launch import launch_command, launch_command_parser

    parser = launch_command_parser()
    args = ["--multi_gpu", "--num_processes", "2", "--main_process_port", port(), "state.py"]
    launch_command(parser.parse_args(args))


def test_accelerate_launch_as_a_subprocess():
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    done = subprocess.run(
        [accelerate, "launch", "--multi_gpu", "--num_processes", "2",
         "--main_process_port", port(), "state.py"],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split())[-4:] == ["0", "1", "STATE", "STATE"], done.stdout
"""

FAIL_RANK1 = """
from accelerate import PartialState

state = PartialState(cpu=True)
print(f"FAIL-SCRIPT rank {state.process_index}", flush=True)
if state.process_index == 1:
    raise RuntimeError("rank one fails on purpose")
state.wait_for_everyone()
"""

STATE = """
import os

from accelerate import PartialState

state = PartialState(cpu=True)
assert state.num_processes == 2, state.num_processes
state.wait_for_everyone()
# one write per line: the two ranks share the launcher's stdout, and print's separate
# writes of "STATE", " ", "0" interleave between them when the output is unbuffered
os.write(1, f"STATE {state.process_index}\\n".encode())
"""

VERDICTS = """
import json
import os

outcomes = {}


def pytest_runtest_logreport(report):
    if report.failed or report.when == "call":
        outcomes[report.nodeid] = report.outcome if report.when == "call" else "error"


def pytest_sessionfinish(session):
    with open(os.environ["VERDICTS_OUT"], "w") as handle:
        json.dump(outcomes, handle)
"""


@pytest.fixture
def project(tmp_path: Path, broker: str) -> Path:
    (tmp_path / "test_accelerate_suite.py").write_text(SUITE.format(scripts=SCRIPTS))
    (tmp_path / "fail_rank1.py").write_text(FAIL_RANK1)
    (tmp_path / "state.py").write_text(STATE)
    (tmp_path / "verdicts.py").write_text(VERDICTS)
    # `torchrun` is this interpreter's (the one on PATH may be another Python's)
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "torchrun").write_text(
        f'#!/bin/sh\nexec {sys.executable} -m torch.distributed.run "$@"\n'
    )
    (folder / "torchrun").chmod(0o755)
    return tmp_path


def _session(project: Path, name: str, *args: str) -> tuple[dict[str, str], str]:
    out = project / f"verdicts-{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        VERDICTS_OUT=str(out),
        ACCELERATE_USE_CPU="true",
        PYTHONPATH=str(project),
        PATH=f"{project / 'bin'}{os.pathsep}{os.environ['PATH']}",
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "verdicts", "-p", "no:cacheprovider", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), (done.stdout + done.stderr)[-3000:]
    return json.loads(out.read_text()), done.stdout + done.stderr


def _about(output: str, nodeids: list[str]) -> str:
    """The failure sections of these tests in a session's output (a section opens with a
    line of underscores naming the test), so a difference shows both sides."""
    names = [nodeid.split("::")[-1] for nodeid in nodeids]
    sections = [
        chunk
        for chunk in output.split("\n_")
        if any(name in chunk.split("\n", 1)[0] for name in names)
    ]
    return "\n_".join(sections)[-6000:] or output[-3000:]


def _tasks(broker: str) -> int:
    with Client(broker, name="accelerate-test") as client:
        return int(client.status()["totals"]["submitted"])


def test_accelerate_scripts_and_launches_give_the_fresh_verdicts_cold_and_warm(
    project: Path, broker: str
) -> None:
    plain, plain_out = _session(project, "plain")
    assert len(plain) == len(SCRIPTS) + 3, plain_out[-3000:]
    assert plain["test_accelerate_suite.py::test_fails_on_rank_one_while_rank_zero_waits"] == (
        "failed"
    )
    for session in ("cold", "warm"):
        before = _tasks(broker)
        got, out = _session(project, session, "--cpq-torchrun")
        differ = sorted(k for k in plain.keys() | got.keys() if plain.get(k) != got.get(k))
        assert got == plain, (
            f"{session}: {differ} differ: {got} != {plain}\n"
            f"--- plain ---\n{_about(plain_out, differ)}\n--- {session} ---\n{out[-6000:]}"
        )
        # every launch ran on a warm group: one task each, no real torchrun said it ran
        assert "running the real torchrun" not in out, out[-3000:]
        assert _tasks(broker) - before >= len(plain), (session, _tasks(broker) - before)
