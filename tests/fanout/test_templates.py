"""The CI templates as shipped: every script parses and passes shellcheck, the Kubernetes
Job and the GitHub workflow validate against their schemas (offline: the schemas ship with
``kubernetes-validate`` and ``check-jsonschema``). The Slurm ones also run, in
``test_slurm.py``.

Tools that are missing fail under CI (``CI=true``: ``.ci/run`` installs them) and skip
elsewhere, with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[2] / "tools" / "ci"
SCRIPTS = sorted(
    p for p in CI.rglob("*") if p.is_file() and p.read_bytes().startswith(b"#!/bin/bash")
)


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if found is None:
        reason = f"{name} is not installed (.ci/run installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def check(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_script_is_found() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"cpq-shards.sbatch", "cpq-merge.sbatch", "submit.sh", "run.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_passes_shellcheck(script: Path) -> None:
    check("bash", "-n", str(script))
    check(tool("shellcheck"), "--shell=bash", "--severity=style", str(script))


def test_kubernetes_job_validates_against_the_schema() -> None:
    check(tool("kubernetes-validate"), "--strict", str(CI / "k8s" / "cpq-shards-job.yaml"))


def test_github_workflows_validate_against_the_schema() -> None:
    workflows = sorted(str(p) for p in (CI / "github").glob("*.yml"))
    assert len(workflows) == 2, workflows  # the matrix, and the Slurm job waiting with --wait
    check(tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", *workflows)
