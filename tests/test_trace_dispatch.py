"""The round trip's trace (tools/trace_dispatch.py, cpq.tracepoints) on a real broker and a
real ws=2 gloo group: every process on the path notes its steps, the ranks too (the
variable reaches them as a start variable), and each step gets its figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))


def test_every_step_of_the_path_is_noted_by_the_process_that_takes_it(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "trace_dispatch.py"), "--tasks", "150",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0 and out.exists(), proc.stdout + proc.stderr
    from trace_dispatch import STEPS

    figures = json.loads(out.read_text())
    # a rank writes its notes 200 at a time: the tasks after its last batch lack them
    assert figures["tasks"] >= 100, proc.stdout
    assert set(figures["p50_us"]) == {name for name, _, _ in STEPS}, proc.stdout
    assert all(value >= 0 for value in figures["p50_us"].values()), proc.stdout
    trip = figures["p50_us"]["round trip"]
    assert all(value <= trip for value in figures["p50_us"].values()), proc.stdout
