"""A session prepared ahead (cpq/caller/prepared.py), end to end: a module that reads the GPU
at import cannot be imported by the warm caller (its forks could not use CUDA), so a fork
that will not fork again imports it before the next caller comes, and becomes that
caller's session. Its verdicts, exit status and output are the session's own (against the
same session with ``CPQ_WARM_CALLER=0``); a session whose conftest changes a ``CUDA_``
variable after that fails closed, and the project's sessions are not prepared again.

There is no GPU here: the module stands in for one that reads it by marking torch's CUDA
initialised in the calling process (``torch.cuda._initialized``), which is what the warm
caller's blame looks at (``probes.cuda_initialised``); in the ranks (``RANK`` set) it does
not, as the ranks' own CUDA is theirs.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from test_warm_caller import (  # the warm caller's harness: a project, its sessions, its log
    PYTEST,
    _env,
    _log,
    _same_output,
    _session,
    _verdicts,
    _wait_until_served_by_a_warm_caller,
    project,
)

__all__ = ["project"]  # the fixture, used by name

#: A package that stays loaded in the warm caller (it registers a torch operator, as
#: Megatron-LM's does), with a submodule that reads the GPU at import and one that needs it.
PACKAGE = """
import torch

@torch.library.custom_op("cpqprepared::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2
"""

#: What ``torch.compile`` does at import in Megatron-LM's modules: set a variable where it is
#: unset (TORCHINDUCTOR_CACHE_DIR), which the module reading the GPU then reads.
SETS_A_VARIABLE = """
import os

os.environ.setdefault("GPUPKG_CACHE_DIR", "/tmp/gpupkg-cache")
"""

READS_GPU = """
import os
import warnings

import torch

CACHE = os.environ["GPUPKG_CACHE_DIR"]

if "RANK" not in os.environ:  # the calling process: what reading the device's name does
    torch.cuda._initialized = True
warnings.warn("probing the device's capability", UserWarning)
with open(os.path.join(os.path.dirname(__file__), "imported.txt"), "a") as log:
    log.write(f"{os.getpid()}\\n")
CAPABILITY = 9
"""

NEEDS_IT = """
from gpupkg import probe

KIND = "hopper" if probe.CAPABILITY >= 9 else "older"
"""


def _with_a_module_reading_the_gpu(
    project: Path, conftest_head: str = "", stays_loaded: bool = True
) -> None:
    package = project / "gpupkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        (PACKAGE if stays_loaded else "") + "\nfrom gpupkg import cachedir\n"
    )
    (package / "cachedir.py").write_text(SETS_A_VARIABLE)
    (package / "probe.py").write_text(READS_GPU)
    (package / "kernels.py").write_text(NEEDS_IT)
    conftest = project / "conftest.py"
    conftest.write_text(conftest_head + "import gpupkg.kernels\n" + conftest.read_text())
    (project / "test_kind.py").write_text(
        "import gpupkg.kernels\n\n"
        "def test_kind():\n"
        "    assert gpupkg.kernels.KIND == 'hopper'\n\n"
        "def test_kind_fails():\n"
        "    assert gpupkg.kernels.KIND == 'older'\n"
    )


def _wait_until_prepared(project: Path) -> None:
    """The warm caller's first prepared session says it is ready (its log)."""
    deadline = time.monotonic() + 120
    while "a session prepared ahead is ready" not in _log(project):
        assert time.monotonic() < deadline, _log(project)
        time.sleep(0.1)  # polling the warm caller's log


def _prepared_sessions(project: Path) -> list[str]:
    return re.findall(r"session (\d+) started \(prepared ahead\)", _log(project))


@pytest.mark.parametrize("stays_loaded", [True, False], ids=["family-stays", "family-held"])
def test_a_module_reading_the_gpu_at_import_is_imported_by_a_session_prepared_ahead(
    project: Path, stays_loaded: bool
) -> None:
    """Whether its family stays loaded in the warm caller (Megatron-LM's on the CPU VM) or
    is held aside until a session imports it (Megatron-LM's on the GPU host): the prepared
    session imports it, and takes the family over as the session would."""
    _with_a_module_reading_the_gpu(project, stays_loaded=stays_loaded)
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    _wait_until_prepared(project)
    own = _session(project, "0", "own")
    handed = _session(project, "1", "handed")
    log = _log(project)
    assert "leaving out gpupkg.probe: its code initialised CUDA, and 1 modules" in log, log
    prepared = _prepared_sessions(project)
    assert len(prepared) == 1, log
    # the session's process imported the module before the session came (and once)
    imported = (project / "gpupkg" / "imported.txt").read_text().split()
    assert imported.count(prepared[0]) == 1, (imported, log)
    assert (handed.returncode, _verdicts(project, "handed")) == (
        own.returncode,
        _verdicts(project, "own"),
    )
    assert "probing the device's capability" in own.stdout
    _same_output(handed.stdout, own.stdout)


def test_a_session_whose_conftest_changes_a_cuda_variable_fails_closed_and_the_next_is_its_own(
    project: Path,
) -> None:
    """The prepared session initialised CUDA under the caller's ``CUDA_VISIBLE_DEVICES``; a
    conftest that sets another one before its imports would, in a fresh process, run on
    other devices. That session fails with a usage error; the project's sessions are not
    prepared again, and the next one runs as its own would."""
    _with_a_module_reading_the_gpu(
        project,
        conftest_head=(
            "import os\n"
            "if 'RANK' not in os.environ:\n"
            "    os.environ['CUDA_VISIBLE_DEVICES'] = '7'\n"
        ),
    )
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    _wait_until_prepared(project)
    failed = _session(project, "1", "failed")
    assert len(_prepared_sessions(project)) == 1, _log(project)
    assert failed.returncode == 4, failed.stdout + failed.stderr
    assert "changed CUDA_VISIBLE_DEVICES after a session prepared ahead" in failed.stderr
    own = _session(project, "0", "own")
    after = _session(project, "1", "after")
    assert len(_prepared_sessions(project)) == 1, _log(project)
    assert (after.returncode, _verdicts(project, "after")) == (
        own.returncode,
        _verdicts(project, "own"),
    )


def test_an_edit_to_a_module_the_prepared_session_imported_is_seen(project: Path) -> None:
    """The prepared session imported ``gpupkg.kernels``; edited after that, the next session
    is not taken by it (it refuses, and exits: it would be stale for every caller) and
    imports the edited module itself, as a fresh process would. The session after that is
    prepared again, with the edited module (a newcomer found one edit ended preparing for
    the warm caller's life)."""
    _with_a_module_reading_the_gpu(project)
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    _wait_until_prepared(project)
    kernels = project / "gpupkg" / "kernels.py"
    kernels.write_text(kernels.read_text().replace(">= 9", ">= 10"))  # now "older"
    edited = _session(project, "1", "edited")
    own = _session(project, "0", "own")
    verdicts = _verdicts(project, "own")
    assert (verdicts["test_kind"], verdicts["test_kind_fails"]) == ("failure", "passed")
    assert _verdicts(project, "edited") == verdicts, edited.stdout
    assert (edited.returncode, own.returncode) == (1, 1)
    log = _log(project)
    assert "did not take a caller: " in log and "kernels.py changed since it was imported" in log
    assert not _prepared_sessions(project), log
    again = _session(project, "1", "again")
    assert len(_prepared_sessions(project)) == 1, _log(project)
    assert (again.returncode, _verdicts(project, "again")) == (own.returncode, verdicts)


#: A barrier in the module that reads the GPU: while ``hold`` exists beside it, its import
#: in a calling process waits (a slow import, as on a busy host), so a caller comes while
#: the session prepared ahead is still importing.
HOLDS = """
import os as _os
import time as _time

_hold = _os.path.join(_os.path.dirname(__file__), "hold")
while "RANK" not in _os.environ and _os.path.exists(_hold):
    _time.sleep(0.05)
"""


def test_a_caller_that_waited_for_the_prepared_session_sees_an_edit_made_meanwhile(
    project: Path,
) -> None:
    """A caller came while the next session was being prepared, and waited for it; a file
    the warm caller had imported was edited meanwhile. The prepared session refuses it
    (stale), and the warm caller, which checked the caller when it came, checks it again
    before it forks for it: the session imports the edited file, as a fresh one does."""
    _with_a_module_reading_the_gpu(project)
    probe = project / "gpupkg" / "probe.py"
    probe.write_text(HOLDS + probe.read_text())
    (project / "gpupkg" / "cachedir.py").write_text(SETS_A_VARIABLE + "LEVEL = 1\n")
    # What the calling process itself reads of it: the exit status its conftest gives.
    conftest = project / "conftest.py"
    conftest.write_text(
        conftest.read_text() + "\n\ndef pytest_sessionfinish(session):\n"
        "    from gpupkg import cachedir\n\n"
        "    if cachedir.LEVEL != 1:\n"
        "        session.exitstatus = 3\n"
    )
    _session(project, "1", "first")
    _wait_until_served_by_a_warm_caller(project)
    _wait_until_prepared(project)
    hold = project / "gpupkg" / "hold"
    hold.touch()
    _session(project, "1", "taken")  # by the first prepared session; the next one waits
    assert len(_prepared_sessions(project)) == 1, _log(project)
    with subprocess.Popen(
        [*PYTEST, f"--junitxml={project.parent / 'waited'}.xml", "-rA"],
        cwd=project,
        env=_env(project, "1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as waited:
        deadline = time.monotonic() + 60
        while "a caller waits for the session being prepared" not in _log(project):
            assert waited.poll() is None and time.monotonic() < deadline, _log(project)
            time.sleep(0.05)  # polling the warm caller's log
        cachedir = project / "gpupkg" / "cachedir.py"
        cachedir.write_text(cachedir.read_text().replace("LEVEL = 1", "LEVEL = 2"))
        hold.unlink()
        output, _ = waited.communicate(timeout=300)
    own = _session(project, "0", "own")
    assert own.returncode == 3, own.stdout
    assert (waited.returncode, _verdicts(project, "waited")) == (
        own.returncode,
        _verdicts(project, "own"),
    ), output
    assert len(_prepared_sessions(project)) == 1, _log(project)  # the waiting one was not
