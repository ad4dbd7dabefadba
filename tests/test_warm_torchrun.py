"""Warm torchrun launches: a suite whose tests launch ``torchrun SCRIPT`` per case gives the
same verdicts under ``pytest --cpq-torchrun`` as without it, cold and warm; ``cpq torchrun``
from a shell gives torchrun's exit status and output. Each behaviour is a difference against
the real torchrun: real broker, real torchrun groups, real gloo.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HELPER = """
import os

MODE = os.environ.get("TRAIN_MODE", "a")  # read once, at import: binds a warm group
"""

TRAIN = """
import os
import sys
import time

import torch
import torch.distributed as dist

import helper

assert not dist.is_initialized(), "a fresh worker starts without a process group"
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
out = sys.argv[1]
with open(os.path.join(out, f"out-{rank}.txt"), "w") as handle:
    handle.write(str(t.item()))
where = f"RANK {os.environ['RANK']} OF {os.environ['WORLD_SIZE']}"
print(f"RESULT {t.item()} MODE {helper.MODE} {where}")
if "--exit" in sys.argv and rank == 1:
    sys.exit(3)
if "--raise" in sys.argv and rank == 0:
    raise ValueError("rank zero broke")
if "--hang" in sys.argv:  # ended by the test's timeout, which kills its launcher
    if rank == 1:
        time.sleep(30)
    os._exit(0)  # no store to leave by then: a plain worker would hang in destroy for good
dist.destroy_process_group()
"""

MODULE = """
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"MODULE RANK {dist.get_rank()}")
dist.destroy_process_group()
"""

CHECKPOINT = """
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
what, folder = sys.argv[1], sys.argv[2]
if what == "save":  # one shard per rank
    torch.save(torch.full((2,), float(rank)), os.path.join(folder, f"shard-{rank}.pt"))
else:  # every rank loads all the shards the bigger world wrote
    shards = sorted(f for f in os.listdir(folder) if f.startswith("shard-"))
    total = sum(torch.load(os.path.join(folder, f)).sum().item() for f in shards)
    assert len(shards) == 4 and total == 12.0, (shards, total)
    print(f"LOADED {len(shards)} on {size}")
dist.barrier()
dist.destroy_process_group()
"""

LAUNCHES = r"""
import os
import re
import subprocess
import sys

import pytest

import torch.distributed.run as distrib_run  # as accelerate imports it

TORCHRUN = ["torchrun"]
PYTHON_M = [sys.executable, "-m", "torch.distributed.run"]


def results(stdout):  # the ranks' result lines (a real torchrun may put two on one line)
    return sorted(re.findall(r"RESULT \S+ MODE \S+ RANK \d OF \d", stdout))


def launch(args, how=TORCHRUN, timeout=120, env=None):
    return subprocess.run(
        [*how, *args], capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, **(env or {})),
    )


def test_passes_and_writes(tmp_path):
    done = launch(["--nproc-per-node", "2", "train.py", str(tmp_path)])
    assert done.returncode == 0, done.stderr
    assert results(done.stdout) == [
        "RESULT 3.0 MODE a RANK 0 OF 2", "RESULT 3.0 MODE a RANK 1 OF 2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out-0.txt", "out-1.txt"]


def test_a_rank_exits_3_and_another_raises(tmp_path):
    done = launch(["--nproc-per-node", "2", "train.py", str(tmp_path), "--exit", "--raise"])
    assert done.returncode == 1
    assert "train.py FAILED" in done.stderr
    assert "ValueError: rank zero broke" in done.stderr


def test_python_m_runs_a_module(tmp_path):
    done = launch(["--nproc-per-node", "2", "-m", "pkg.mod"], PYTHON_M)
    assert done.returncode == 0, done.stderr
    assert sorted(re.findall(r"MODULE RANK \d", done.stdout)) == ["MODULE RANK 0", "MODULE RANK 1"]


def test_hang_ended_by_timeout_then_a_launch_passes(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        launch(["--nproc-per-node", "2", "train.py", str(tmp_path), "--hang"], timeout=6)
    done = launch(["--nproc-per-node", "2", "train.py", str(tmp_path)])
    assert done.returncode == 0, done.stderr


def test_run_called_in_process(tmp_path):  # what `accelerate launch` does
    args = distrib_run.get_args_parser().parse_args(
        ["--nproc-per-node", "2", "train.py", str(tmp_path)])
    distrib_run.run(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out-0.txt", "out-1.txt"]


def test_variable_read_at_import_follows_each_launch(tmp_path):
    first = launch(["--nproc-per-node", "2", "train.py", str(tmp_path)], env={"TRAIN_MODE": "b"})
    second = launch(["--nproc-per-node", "2", "train.py", str(tmp_path)])
    assert "MODE b" in first.stdout and "MODE a" not in first.stdout
    assert "MODE a" in second.stdout and "MODE b" not in second.stdout


def test_the_working_directory_is_not_on_a_workers_path(tmp_path):
    # a module beside the caller, not beside the script: importable only through PYTHONPATH
    alone = launch(["--nproc-per-node", "2", "scripts/uses_local.py"], env={"PYTHONPATH": ""})
    assert alone.returncode == 1, alone.stderr
    assert "No module named 'localmod'" in alone.stderr
    on_path = launch(["--nproc-per-node", "2", "scripts/uses_local.py"])
    assert on_path.returncode == 0, on_path.stderr
    assert on_path.stdout.count("LOCAL OK") == 2


def test_save_with_four_load_with_two(tmp_path):
    saved = launch(["--nproc-per-node", "4", "ckpt.py", "save", str(tmp_path)])
    assert saved.returncode == 0, saved.stderr
    loaded = launch(["--nproc-per-node", "2", "ckpt.py", "load", str(tmp_path)])
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.count("LOADED 4 on 2") == 2
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
def project(pytester: pytest.Pytester, broker: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CPQ_ENDPOINT", broker)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    monkeypatch.delenv("CPQ_TORCHRUN", raising=False)
    monkeypatch.delenv("TRAIN_MODE", raising=False)
    pytester.makepyfile(
        helper=HELPER, train=TRAIN, ckpt=CHECKPOINT, test_launches=LAUNCHES, verdicts=VERDICTS
    )
    (pytester.path / "pkg").mkdir()
    (pytester.path / "pkg" / "__init__.py").write_text("")
    (pytester.path / "pkg" / "mod.py").write_text(MODULE)
    (pytester.path / "localmod.py").write_text("VALUE = 'LOCAL OK'\n")
    (pytester.path / "scripts").mkdir()
    (pytester.path / "scripts" / "uses_local.py").write_text(
        "import localmod\n\nprint(localmod.VALUE)\n"
    )
    return pytester.path


def _session(project: Path, name: str, *args: str) -> tuple[dict[str, str], str]:
    out = project / f"verdicts-{name}.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "verdicts",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            *args,
        ],
        cwd=project,
        env=dict(os.environ, VERDICTS_OUT=str(out)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return json.loads(out.read_text()), done.stdout + done.stderr


def test_a_suite_of_launches_gives_the_same_verdicts_warm(project: Path) -> None:
    """One session starts its groups (a spec's first launch) and reuses them (every later
    launch of the spec: test_variable_read... and test_hang... launch twice, and most tests
    share the ws=2 spec), so it is compared cold and warm in one run."""
    plain, plain_out = _session(project, "plain")
    assert set(plain.values()) == {"passed"} and len(plain) == 8, plain_out[-3000:]
    got, out = _session(project, "cpq", "--cpq-torchrun")
    assert got == plain, f"{got} != {plain}\n{out[-4000:]}"
    # Every launch ran on a warm group: no real torchrun said it ran.
    assert "running the real torchrun" not in out


def test_cpq_torchrun_from_a_shell_matches_torchrun(project: Path, tmp_path: Path) -> None:
    def both(*args: str) -> tuple[subprocess.CompletedProcess[str], ...]:
        runs = []
        for command in (["torchrun"], [sys.executable, "-m", "cpq", "torchrun"]):
            out = tmp_path / command[-1]
            out.mkdir(exist_ok=True)
            runs.append(
                subprocess.run(
                    [*command, *[a.replace("OUT", str(out)) for a in args]],
                    cwd=project,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
            )
        return tuple(runs)

    def lines(text: str) -> list[str]:
        """The ranks' result lines (a real torchrun may interleave two ranks' on a line)."""
        return sorted(re.findall(r"(?:\[default\d\]:)?RESULT \S+ MODE \S+ RANK \d OF \d", text))

    real, warm = both("--nproc-per-node", "2", "train.py", "OUT", "--raise")
    assert real.returncode == warm.returncode == 1
    assert lines(real.stdout) == lines(warm.stdout)
    # the rank's own traceback as a torchrun worker prints it: the script's frame first, its
    # path absolute, each line prefixed by torch's excepthook (the script initialised)
    trace = re.compile(r'\[rank0\]: Traceback \(most recent call last\):\n\[rank0\]:   File "(.*)"')
    found = trace.search(warm.stderr)
    assert found and found.group(1) == str(project / "train.py"), warm.stderr
    assert trace.search(real.stderr), real.stderr
    assert "train.py FAILED" in real.stderr and "train.py FAILED" in warm.stderr
    real, warm = both("--nproc-per-node", "2", "--tee", "3", "train.py", "OUT")
    assert real.returncode == warm.returncode == 0
    assert lines(real.stdout) == lines(warm.stdout)
    # what cpq cannot make faithful runs the real torchrun, said once
    real, warm = both("--no-python", "--nproc-per-node", "1", "true")
    assert real.returncode == warm.returncode == 0
    assert warm.stderr.count("cpq torchrun: running the real torchrun: --no-python") == 1


def test_help_is_torchruns_with_cpqs_word_first(tmp_path: Path) -> None:
    """``cpq torchrun --help`` says what cpq does, then gives torchrun's own help and exit
    status (it said "cpq does not know the option --help"); a script's own ``--help`` is the
    script's."""
    real = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    warm = subprocess.run(
        [sys.executable, "-m", "cpq", "torchrun", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert real.returncode == warm.returncode == 0, warm.stderr
    assert warm.stdout.startswith("cpq torchrun: torchrun's command line, run on a warm group")
    assert warm.stdout.endswith(real.stdout), warm.stdout[-500:]
    assert "running the real torchrun" not in warm.stderr, warm.stderr

    from cpq.client.torchrun import plan

    own = plan(["--nproc-per-node", "2", "script.py", "--help"])
    assert own.launch.argv == ["script.py", "--help"] and not own.launch.unknown


ATEXIT_SCRIPT = """
import atexit, os, sys

def bye(path):
    with open(path, "a") as handle:
        handle.write("bye\\n")

atexit.register(bye, os.path.join(sys.argv[1], f"bye-{os.environ['RANK']}.txt"))
"""


def test_a_scripts_atexit_handler_runs_on_every_rank_as_under_torchrun(
    project: Path, tmp_path: Path
) -> None:
    """A worker's exit runs what its script registered with ``atexit``; a warm rank runs it
    at the launch's end (cpq.rank.exits), once per launch."""
    (project / "bye.py").write_text(ATEXIT_SCRIPT)
    runs = {}
    for name, command in (
        ("real", ["torchrun"]),
        ("cold", [sys.executable, "-m", "cpq", "torchrun"]),
        ("warm", [sys.executable, "-m", "cpq", "torchrun"]),
    ):
        out = tmp_path / name
        out.mkdir()
        run = subprocess.run(
            [*command, "--nproc-per-node", "2", "bye.py", str(out)],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        runs[name] = out
    written = {name: {p.name: p.read_text() for p in out.iterdir()} for name, out in runs.items()}
    assert written["real"] == {"bye-0.txt": "bye\n", "bye-1.txt": "bye\n"}
    assert written["cold"] == written["warm"] == written["real"], written
