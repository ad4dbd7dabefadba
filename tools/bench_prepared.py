"""The session prepared ahead on CPU: a handed-over session's wall with and without it.

A project whose conftest imports a module that "reads the GPU" at import (it marks torch's
CUDA initialised in the calling process, what the warm caller's blame looks at) and, like
Megatron-LM's kernels, pulls in ``torch._inductor`` through it — what the warm caller must
leave to each session, unless a session prepared ahead imports it. Two state directories,
one with ``CPQ_PREPARE_AHEAD=0``; in each a broker, a first session (it starts the warm
caller), then ``--sessions`` handed-over sessions, each after the warm caller is ready
(``--pause`` seconds between them: a developer's edit-run cycle).

Usage: python tools/bench_prepared.py [--sessions 4] [--pause 8]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGE = {
    "gpupkg/__init__.py": "",
    "gpupkg/probe.py": (
        "import os\nimport torch\nimport torch._inductor.decomposition  # noqa: F401\n"
        "if 'RANK' not in os.environ:\n    torch.cuda._initialized = True\nCAPABILITY = 9\n"
    ),
    "gpupkg/kernels.py": (
        "from gpupkg import probe\nKIND = 'hopper' if probe.CAPABILITY >= 9 else 'x'\n"
    ),
    "conftest.py": "import gpupkg.kernels  # noqa: F401\n",
    "test_kind.py": (
        "import gpupkg.kernels\n\n"
        + "".join(
            f"def test_kind_{i}():\n    assert gpupkg.kernels.KIND == 'hopper'\n\n"
            for i in range(10)
        )
    ),
    "pytest.ini": "[pytest]\n",
}


def _log(state: Path) -> str:
    return "".join(p.read_text() for p in (state / "callers").glob("*.log"))


def _wait_for(state: Path, pattern: str, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(re.findall(pattern, _log(state))) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {pattern!r}:\n{_log(state)[-2000:]}")
        time.sleep(0.2)


class Mode:
    """One state directory: its broker, its warm caller, its sessions' walls."""

    def __init__(self, project: Path, prepare: bool) -> None:
        self.project, self.prepare = project, prepare
        self.walls: list[float] = []
        self.state = Path(tempfile.mkdtemp(prefix="cpq-bp-"))
        os.chmod(self.state, 0o700)
        self.env = dict(os.environ, CPQ_STATE_DIR=str(self.state), CPQ_WARM_CALLER="1")
        self.env["CPQ_PREPARE_AHEAD"] = "1" if prepare else "0"
        self.broker = subprocess.Popen(
            [sys.executable, "-m", "cpq", "broker", "--gpus", "none"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly"]
        self.command += ["-p", "no:cacheprovider", "--cpq-world-size", "1"]

    def session(self) -> float:
        started = time.perf_counter()
        done = subprocess.run(
            self.command, cwd=self.project, env=self.env, capture_output=True, timeout=300
        )
        assert b"10 passed" in done.stdout, done.stdout[-2000:]
        return time.perf_counter() - started

    def ready(self, n: int) -> None:
        if n == 0:
            _wait_for(self.state, r" serving ", 1)
        if self.prepare:
            _wait_for(self.state, r"a session prepared ahead is ready", n + 1)

    def stop(self) -> None:
        served = len(re.findall(r"started \(prepared ahead\)", _log(self.state)))
        subprocess.run([sys.executable, "-m", "cpq", "stop"], env=self.env, capture_output=True)
        self.broker.wait(timeout=60)
        assert served == (len(self.walls) if self.prepare else 0), _log(self.state)[-3000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--pause", type=float, default=8.0)
    args = parser.parse_args()
    project = Path(tempfile.mkdtemp(prefix="cpq-bp-proj-"))
    for name, text in PACKAGE.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    modes = [Mode(project, prepare=False), Mode(project, prepare=True)]
    try:
        for mode in modes:
            mode.session()  # the first: it starts the mode's warm caller
        for n in range(args.sessions):  # the modes in turn: a machine's load hits both alike
            for mode in modes:
                time.sleep(args.pause)  # the edit-run cycle; the warm caller prepares meanwhile
                mode.ready(n)
                mode.walls.append(mode.session())
    finally:
        for mode in modes:
            mode.stop()
    print("| handed-over session | walls (s) | median |")
    print("| --- | --- | --- |")
    for mode in modes:
        label = "prepared ahead" if mode.prepare else "plain fork (CPQ_PREPARE_AHEAD=0)"
        shown = ", ".join(f"{w:.2f}" for w in mode.walls)
        print(f"| {label} | {shown} | {statistics.median(mode.walls):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
