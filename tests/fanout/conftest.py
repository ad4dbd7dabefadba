"""A real two-node Slurm cluster for the fan-out tests (one per session, started on demand).

Skipped with the reason when the Slurm or munge binaries are missing, except under CI
(``CI=true``), where it fails: CI installs them (``.ci/run``) and must not skip silently.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .slurm import SlurmCluster, missing_binaries


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    missing = missing_binaries()
    if missing:
        reason = (
            f"Slurm binaries missing: {', '.join(missing)} (apt-get install "
            "--no-install-recommends slurmctld slurmd slurm-client munge; .ci/run does)"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    directory = Path(tempfile.mkdtemp(prefix="cpq-slurm-"))  # short: socket paths live here
    cluster = SlurmCluster(directory)
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)
        if directory.exists():  # a file written while it was removed: once more
            shutil.rmtree(directory, ignore_errors=True)
    assert not left, f"processes outlived their Slurm jobs and were killed: {left}"
