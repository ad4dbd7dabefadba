"""The soak (tools/soak.py) in miniature, as CI runs it: 2 clients x 40 tasks, 10 % faults.

A private broker, real ws=2 gloo groups, seeded faults (the same ones every run): every
task gets exactly one verdict and it is the expected one, nothing is lost or duplicated,
and no process of the run outlives its broker. The full-size run and its figures are in
RELIABILITY.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_short_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "soak.py"), "--clients", "2", "--tasks", "40",
         "--fault-rate", "0.1", "--quiet", "--json", str(out)],
        capture_output=True, text=True, timeout=420, cwd=ROOT,
    )  # fmt: skip
    assert out.exists(), proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    summary = proc.stdout
    assert report["tasks"] == 80
    assert sum(report["faults"].values()) > 0, summary  # the seed does inject faults
    assert report["lost"] == 0, summary
    assert report["duplicated"] == 0, summary
    assert report["orphans"] == 0, summary + "\n".join(report["orphan_cmdlines"])
    assert report["unexpected"] == [], summary
    assert report["expected_ok"] == 80, summary
    assert report["retries"] >= 1, summary  # infra faults were retried
    assert report["ok"] and proc.returncode == 0, summary + proc.stderr
