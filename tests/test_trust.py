"""Who may connect: the security boundary of a service that runs the code it is sent.

* ``ipc://`` (the default): the socket lives in a per-user 0700 directory, refused when
  another user owns it or it is open to others; the socket itself is created 0700 too, so
  even a reachable socket is no use to another user (checked as ``nobody``).
* ``tcp://``: refused without CURVE keys, ``--insecure`` only on loopback; with keys only an
  authorised client key gets through, and only to the server key it expects.

No test here starts a worker group. tcp tests use 127.0.0.1 and ports the kernel picked.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, start_broker, stop_broker

from cpq import BrokerUnavailable, Client, paths, security

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, setuid)")


def cpq_cli(*args: str, env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cpq", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def clean_env() -> dict[str, str]:
    """This session's broker exports CPQ_ENDPOINT/CPQ_STATE_DIR; these tests must not."""
    return {k: v for k, v in os.environ.items() if k not in ("CPQ_ENDPOINT", "CPQ_STATE_DIR")}


# --------------------------------------------------------------------------- ipc


def test_default_endpoint_is_in_a_private_per_user_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CPQ_ENDPOINT", raising=False)
    monkeypatch.delenv("CPQ_STATE_DIR", raising=False)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert paths.default_endpoint() == f"ipc://{runtime / 'cpq' / 'broker.sock'}"
    info = (runtime / "cpq").stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert paths.state_dir() == Path(f"/tmp/cpq-{os.getuid()}")  # the fallback, checked too


def _owned_by_nobody(path: Path) -> str:
    path.mkdir(mode=0o700)
    os.chown(path, NOBODY, NOBODY)
    return f"is owned by uid {NOBODY}, not by you ({os.getuid()})"


def _open_to_others(path: Path) -> str:
    path.mkdir()
    path.chmod(0o755)
    return f"has mode 755; it must be 0700 (fix: chmod 700 {path})"


def _group_writable(path: Path) -> str:
    path.mkdir()
    path.chmod(0o770)
    return "has mode 770; it must be 0700"


def _symlink(path: Path) -> str:
    target = path.with_name("elsewhere")
    target.mkdir(mode=0o700)
    path.symlink_to(target)
    return "is not a plain directory"


@pytest.mark.parametrize(
    ("make", "command"),
    [
        pytest.param(_owned_by_nobody, "broker", marks=as_root, id="other-owner-broker"),
        pytest.param(_owned_by_nobody, "submit", marks=as_root, id="other-owner-submit"),
        pytest.param(_open_to_others, "status", id="mode-755-status"),
        pytest.param(_group_writable, "broker", id="mode-770-broker"),
        pytest.param(_symlink, "status", id="symlink-status"),
    ],
)
def test_unsafe_state_directory_is_refused_with_the_reason(
    tmp_path: Path, make: object, command: str
) -> None:
    state = tmp_path / "state"
    words = make(state)  # type: ignore[operator]
    with pytest.raises(paths.UnsafeStateDir, match=r"must be 0700|not by you|not a plain"):
        paths.ensure_private_dir(state)
    argv = {
        "broker": ["broker"],
        "status": ["status"],
        "submit": ["submit", "--world-size", "2", "workers.collectives:noop"],
    }[command]
    env = {**clean_env(), "CPQ_STATE_DIR": str(state)}
    proc = subprocess.run(
        [sys.executable, "-m", "cpq", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert words in proc.stderr
    assert "refusing to run" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(state.resolve().iterdir())  # nothing was created in it


@pytest.fixture(scope="module")
def ipc_broker() -> Iterator[tuple[str, Path]]:
    """A broker whose private state directory sits in a directory everyone may enter, so
    only cpq's own permissions stand between another user and the socket."""
    parent = Path(tempfile.mkdtemp(prefix="cpq-trust-"))
    parent.chmod(0o755)
    state = parent / "state"
    process, endpoint = start_broker(state, "--gpus", "none", "--max-ranks", "1")
    try:
        yield endpoint, state
    finally:
        stop_broker(process)
        subprocess.run(["rm", "-rf", str(parent)], check=False)


_CONNECT_AS = """
import os, socket, sys
import cpq.security  # the client imports it lazily; nobody cannot read root's site-packages
from cpq import BrokerUnavailable, Client
path, uid = sys.argv[1], int(sys.argv[2])
if uid >= 0:  # everything is imported; now become that user
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    raw.connect(path)
    print("raw: connected")
except PermissionError:
    print("raw: permission denied")
try:
    Client("ipc://" + path, connect_timeout_s=2).close()
    print("client: connected")
except BrokerUnavailable:
    print("client: no answer")
"""


@pytest.mark.parametrize(
    ("uid", "state_mode", "expected"),
    [
        pytest.param(-1, 0o700, "raw: connected\nclient: connected", id="owner"),
        pytest.param(NOBODY, 0o700, "raw: permission denied\nclient: no answer", id="nobody"),
        # Even with the directory opened up by mistake, the socket's own mode (bound under
        # umask 077) keeps another user out.
        pytest.param(NOBODY, 0o755, "raw: permission denied\nclient: no answer",
                     id="nobody-open-dir"),
    ],
)  # fmt: skip
@as_root
def test_socket_is_usable_by_its_owner_only(
    ipc_broker: tuple[str, Path], uid: int, state_mode: int, expected: str
) -> None:
    endpoint, state = ipc_broker
    sock = endpoint[len("ipc://") :]
    assert stat.S_IMODE(os.stat(sock).st_mode) & 0o077 == 0, oct(os.stat(sock).st_mode)
    state.chmod(state_mode)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CONNECT_AS, sock, str(uid)],
            env={**clean_env(), "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=30,
            cwd="/",
        )
    finally:
        state.chmod(0o700)
    assert proc.stdout.strip() == expected, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- tcp


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tcp_broker_env(state: Path, keys: Path) -> dict[str, str]:
    return {**clean_env(), "CPQ_STATE_DIR": str(state), "CPQ_KEYS_DIR": str(keys)}


def _lock_held(path: Path) -> bool:
    try:
        with open(path) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False
    except FileNotFoundError:
        return False


@pytest.fixture
def tcp_broker(tmp_path: Path) -> Iterator[object]:
    """``start(endpoint, keys_dir, *args)``: a broker on a tcp endpoint, up and serving."""
    started: list[subprocess.Popen[bytes]] = []

    def start(endpoint: str, keys: Path, *args: str) -> subprocess.Popen[bytes]:
        state = tmp_path / f"state{len(started)}"
        state.mkdir(mode=0o700)
        log = open(state / "broker.stdout", "wb")  # noqa: SIM115 - as long as the broker
        process = subprocess.Popen(
            [sys.executable, "-m", "cpq.broker", "--endpoint", endpoint, "--gpus", "none",
             *args],
            env={**tcp_broker_env(state, keys), "PYTHONPATH": str(ROOT)},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )  # fmt: skip
        started.append(process)
        safe = "".join(c if c.isalnum() else "_" for c in endpoint)
        deadline = time.monotonic() + 30
        while not _lock_held(state / f"{safe}.lock"):
            assert process.poll() is None, (state / "broker.stdout").read_text()
            assert time.monotonic() < deadline, "the broker did not start"
            time.sleep(0.02)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            stop_broker(process)


def test_cpq_keys_makes_a_private_key_pair_and_an_authorised_folder(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    proc = cpq_cli("keys", "--dir", str(keys), env={})
    assert proc.returncode == 0, proc.stderr
    assert str(keys) in proc.stdout
    names = {p.name for p in keys.iterdir()}
    assert {"server.key", "server.key_secret", "client.key", "client.key_secret"} <= names
    assert [p.name for p in (keys / "authorized").iterdir()] == ["client.key"]
    assert (keys / "authorized" / "client.key").read_text() == (keys / "client.key").read_text()
    for directory in (keys, keys / "authorized"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for secret in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((keys / secret).stat().st_mode) == 0o600


def test_cpq_keys_keeps_existing_keys_unless_forced(tmp_path: Path) -> None:
    """A silent regeneration would lock out every client that pinned the old server key."""
    keys = tmp_path / "keys"
    assert cpq_cli("keys", "--dir", str(keys), env={}).returncode == 0
    before = {p.name: p.read_bytes() for p in keys.glob("*.key*")}
    again = cpq_cli("keys", "--dir", str(keys), env={})
    assert again.returncode == 0  # kept, as the README says: the keys are there to use
    assert "already holds" in again.stderr and "kept" in again.stderr
    assert "--force" in again.stderr
    assert "Traceback" not in again.stderr
    assert {p.name: p.read_bytes() for p in keys.glob("*.key*")} == before
    forced = cpq_cli("keys", "--dir", str(keys), "--force", env={})
    assert forced.returncode == 0, forced.stderr
    after = {p.name: p.read_bytes() for p in keys.glob("*.key*")}
    assert after.keys() == before.keys()
    assert after["server.key"] != before["server.key"]
    assert (keys / "authorized" / "client.key").read_bytes() == after["client.key"]


@pytest.mark.parametrize(
    ("host", "insecure", "words"),
    [
        ("127.0.0.1", False, "no CURVE keys were found"),
        ("0.0.0.0", True, "--insecure is only allowed on a loopback address"),
        ("*", True, "--insecure is only allowed on a loopback address"),
    ],
    ids=["no-keys", "insecure-any-address", "insecure-wildcard"],
)
def test_tcp_without_keys_is_refused(tmp_path: Path, host: str, insecure: bool, words: str) -> None:
    state, keys = tmp_path / "state", tmp_path / "no-keys"
    state.mkdir(mode=0o700)
    endpoint = f"tcp://{host}:{free_port()}"
    args = ["broker", "--endpoint", endpoint, "--gpus", "none"]
    proc = cpq_cli(*args, *(["--insecure"] if insecure else []), env=tcp_broker_env(state, keys))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert words in proc.stderr
    assert "Traceback" not in proc.stderr


def test_insecure_tcp_on_loopback_serves(
    tmp_path: Path, tcp_broker: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CPQ_KEYS_DIR", str(tmp_path / "no-keys"))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    process = tcp_broker(endpoint, tmp_path / "no-keys", "--insecure")  # type: ignore[operator]
    with Client(endpoint, connect_timeout_s=10) as client:
        assert client.status()["broker"]["pid"] == process.pid


def test_curve_lets_only_an_authorised_key_through(
    tmp_path: Path, tcp_broker: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = security.generate_keys(tmp_path / "keys")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    process = tcp_broker(endpoint, keys)  # type: ignore[operator]

    monkeypatch.setenv("CPQ_KEYS_DIR", str(keys))
    with Client(endpoint, connect_timeout_s=10) as client:
        assert client.status()["broker"]["pid"] == process.pid

    # A key pair of its own, trusting the right server: not in the authorised folder.
    stranger = security.generate_keys(tmp_path / "stranger")
    (stranger / "server.key").write_text((keys / "server.key").read_text())
    # The authorised client key pair, expecting another server (a man in the middle).
    fooled = security.generate_keys(tmp_path / "fooled")
    for name in ("client.key", "client.key_secret"):
        (fooled / name).write_text((keys / name).read_text())
    # No keys at all: a plain connection to a CURVE server.
    nothing = tmp_path / "nothing"
    nothing.mkdir(mode=0o700)
    for who in (stranger, fooled, nothing):
        monkeypatch.setenv("CPQ_KEYS_DIR", str(who))
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="no answer from a cpq broker"):
            Client(endpoint, connect_timeout_s=2)
        assert time.monotonic() - started < 10
    monkeypatch.setenv("CPQ_KEYS_DIR", str(keys))
    with Client(endpoint, connect_timeout_s=10) as client:  # and it still serves its own
        assert client.status()["totals"]["malformed"] == 0


def test_curve_broker_refuses_an_authorised_folder_others_can_write(tmp_path: Path) -> None:
    keys = security.generate_keys(tmp_path / "keys")
    (keys / "authorized").chmod(0o777)  # anyone could authorise themselves
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = cpq_cli(
        "broker", "--endpoint", endpoint, "--gpus", "none", env=tcp_broker_env(state, keys)
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{keys / 'authorized'} has mode 777; it must be 0700" in proc.stderr
