"""``cpq broker`` from a folder that holds a ``cpq`` folder (the parent of a clone, found by a
newcomer): the broker it becomes imports the installed package, not that folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(sys.version_info < (3, 11), reason="-P (no working directory on the path)")
def test_cpq_broker_started_beside_a_cpq_folder_runs_the_installed_broker(tmp_path: Path) -> None:
    (tmp_path / "cpq").mkdir()
    (tmp_path / "cpq" / "__init__.py").write_text("raise ImportError('the wrong cpq')\n")
    # `cpq` as its console script runs it: the script's folder first on the path, not the cwd
    done = subprocess.run(
        [sys.executable, "-P", "-c", "from cpq.client.cli import main; main(['broker', '--help'])"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "the wrong cpq" not in done.stderr
    assert "--gpus" in done.stdout
