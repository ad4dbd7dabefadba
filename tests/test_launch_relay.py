"""The launch relay (cpq/client/launch_relay.py): under ``pytest --cpq-torchrun`` a test's
``torchrun`` is a stdlib-only shim that hands its launch to the pytest process's client.

End to end on a real broker, real torchrun groups, real gloo: launches are served by the
session's relay (``cpq status`` shows its client), a launch killed by its test's time-out is
cancelled at once, and a launch cpq cannot make faithful still runs the real torchrun, said
once. The relay's own socket is checked with requests a shim would never send: each gets a
"fallback" answer (the shim then runs ``cpq torchrun`` itself), never a launch. The verdicts
of routed launches against the real torchrun are tests/test_warm_torchrun.py's, which now
run through the relay.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cpq.client.launch_relay import _BROKER_VARS, SHIM, LaunchRelay, read_frame

pytest_plugins = ["pytester"]

SCRIPT = """
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
print(f"RANK {dist.get_rank()} ARGS {sys.argv[1:]}", flush=True)
if "--hang" in sys.argv:
    time.sleep(600)
dist.destroy_process_group()
"""

TESTS = r"""
import json
import os
import subprocess
import sys
import time

import pytest


def launch(*args, timeout=120):
    return subprocess.run(
        ["torchrun", "--nproc-per-node", "2", *args], capture_output=True, text=True,
        timeout=timeout,
    )


def status():
    done = subprocess.run([sys.executable, "-m", "cpq", "status", "--json"],
                          capture_output=True, text=True, timeout=60)
    return json.loads(done.stdout)


def test_served_by_this_sessions_relay():
    done = launch("script.py", "one")
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["RANK 0 ARGS ['one']", "RANK 1 ARGS ['one']"]
    names = [c.get("name", "") for c in status()["clients"]]
    assert f"cpq-torchrun relay {os.getpid()}" in names, names


def test_a_launch_killed_by_its_timeout_is_cancelled():
    with pytest.raises(subprocess.TimeoutExpired):
        launch("script.py", "--hang", timeout=4)
    # the launch's own deadline is an hour: only the cancel frees its group this soon
    deadline = time.monotonic() + 30
    while any(p["state"] == "busy" for p in status()["pools"]):
        assert time.monotonic() < deadline, status()["pools"]
        time.sleep(0.2)
    done = launch("script.py", "two")
    assert done.returncode == 0, done.stderr


def test_what_cannot_run_warm_runs_the_real_torchrun():
    done = launch("--max-restarts", "1", "script.py", "three")
    assert done.returncode == 0, done.stderr
    said = "cpq torchrun: running the real torchrun: --max-restarts above 0"
    assert done.stderr.count(said) == 1, done.stderr
    assert "RANK 1 ARGS ['three']" in done.stdout
"""


@contextlib.contextmanager
def own_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Iterator[str]:
    """A broker of this test's own (no autostart, no relay of the outer session), its
    endpoint named in the environment the test's sessions inherit."""
    from conftest import start_broker

    from cpq.client.autostart import stop_broker

    process, endpoint = start_broker(tmp_path / "state", *args)
    try:
        monkeypatch.setenv("CPQ_ENDPOINT", endpoint)
        monkeypatch.setenv("CPQ_AUTOSTART", "0")
        monkeypatch.delenv("CPQ_LAUNCH_RELAY", raising=False)
        yield endpoint
    finally:
        stop_broker(process)


def test_a_sessions_launches_go_through_its_relay(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a broker of its own: pytester's HOME would become part of the shared broker's specs
    with own_broker(tmp_path, monkeypatch):
        pytester.makepyfile(script=SCRIPT, test_relayed=TESTS)
        command = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider"]
        done = subprocess.run(
            [*command, "--cpq-torchrun", "-q", "test_relayed.py"],
            cwd=pytester.path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        assert "3 passed" in done.stdout


# ---- the relay's socket, asked what no shim asks


@pytest.fixture
def relay() -> Iterator[LaunchRelay]:
    started = LaunchRelay.start("ipc:///nonexistent/cpq-test-broker.sock")
    assert started is not None
    yield started
    started.close()


def _ask(relay: LaunchRelay, raw: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(relay.path)
        conn.sendall(raw)
        data = read_frame(conn)
    assert data is not None, "the relay closed without an answer"
    reply: dict[str, Any] = json.loads(data)
    return reply


def _request(**fields: Any) -> bytes:
    """A shim's request from this process's environment (its broker variables), but
    ``fields``."""
    value = {"v": 1, "argv": ["script.py"], "python": sys.executable, "cwd": os.getcwd()}
    value["env"] = {k: os.environ[k] for k in _BROKER_VARS if k in os.environ}
    value.update(fields)
    body = json.dumps(value).encode()
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (struct.pack(">I", 5) + b"{nope", "could not read the request: not JSON"),
        (_request(v=2), "not a version 1 request"),
        (_request(argv="script.py"), "argv is not a list of strings"),
        (_request(env={"A": 1}), "env is not a map of strings"),
        (_request(cwd="relative"), "cwd is not an absolute path"),
        (_request(extra=True), "unknown fields ['extra']"),
        (struct.pack(">I", 1 << 30), "a request of 1073741824 bytes"),
        (_request(argv=["--nnodes", "2", "script.py"]), "cpq runs single-node launches"),
        (_request(env={"CPQ_ENDPOINT": "ipc:///elsewhere.sock"}), "another broker"),
        (_request(python="/usr/bin/other-python"), "another interpreter"),
    ],
    ids=[
        "not-json",
        "version",
        "argv",
        "env",
        "cwd",
        "unknown-field",
        "too-big",
        "multi-node",
        "other-broker",
        "other-python",
    ],
)
def test_the_relay_answers_fallback_to_what_it_does_not_serve(
    relay: LaunchRelay, raw: bytes, why: str
) -> None:
    reply = _ask(relay, raw)
    assert set(reply) == {"fallback"}, reply
    assert why in reply["fallback"]


def test_a_shim_whose_relay_is_gone_runs_cpq_torchrun_itself(tmp_path: Path) -> None:
    shim = tmp_path / "cpq_launch.py"
    shim.write_text(SHIM)
    env = dict(os.environ, CPQ_LAUNCH_RELAY=str(tmp_path / "gone.sock"), CPQ_AUTOSTART="0")
    env["CPQ_ENDPOINT"] = f"ipc://{tmp_path / 'no-broker.sock'}"
    done = subprocess.run(
        [sys.executable, "-sS", str(shim), "--no-python", "--nproc-per-node", "1", "true"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "cpq torchrun: running the real torchrun: --no-python" in done.stderr


LAUNCHING = """
import subprocess

import pytest


@pytest.mark.parametrize("case", range(4))
def test_launch(case):
    done = subprocess.run(["torchrun", "--nproc-per-node", "2", "script.py", str(case)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"RANK 1 ARGS ['{case}']" in done.stdout
"""


def test_shell_serial_and_xdist_launches_share_one_spec(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: a shell's ``cpq torchrun``, a serial ``--cpq-torchrun`` session and an
    ``-n 2`` one launch the same script of one project: one spec (the route folder in
    ``PATH`` and, twice under xdist, in ``PYTHONPATH`` is no part of it), so groups serve
    all three instead of a group and a spare each."""
    pytest.importorskip("xdist")
    from cpq import Client

    with own_broker(tmp_path, monkeypatch, "--spares", "0") as endpoint:
        pytester.makepyfile(script=SCRIPT, test_launching=LAUNCHING)
        run = {"cwd": pytester.path, "capture_output": True, "text": True, "timeout": 600}
        shell = subprocess.run(
            [sys.executable, "-m", "cpq", "torchrun", "--nproc-per-node", "2", "script.py", "x"],
            **run,  # type: ignore[call-overload]
        )
        assert shell.returncode == 0, shell.stderr
        pytest_args = [sys.executable, "-m", "pytest", "-p", "no:randomly", "--cpq-torchrun"]
        for extra in ([], ["-n", "2"]):
            done = subprocess.run([*pytest_args, *extra, "-q"], **run)  # type: ignore[call-overload]
            assert done.returncode == 0, done.stdout[-3000:]
        with Client(endpoint) as client:
            status = client.status()
        specs = {pool["spec_id"] for pool in status["pools"]}
        assert len(specs) == 1, [pool["env"] for pool in status["pools"]]
        # two groups at most: the xdist workers' launches may overlap
        assert 1 <= status["totals"]["groups_started"] <= 2, status["totals"]
        assert status["totals"]["submitted"] == 9
