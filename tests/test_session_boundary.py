"""The session boundary against fresh runs, end to end on CPU: one pytest session leaves
torch's switches set (and a list in the project's own module grown); the next session,
on the same warm group, gets a fresh ``torchrun -m pytest``'s verdicts
(``tools/boundary_check.py``, which the GPU host also runs with its CUDA rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_next_session_finds_a_fresh_processs_state(
    tmp_path: Path, broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CPQ_ENDPOINT", broker)
    monkeypatch.delenv("CPQ_WORLD_SIZE", raising=False)
    out = tmp_path / "rows.json"
    tool = str(ROOT / "tools" / "boundary_check.py")
    done = subprocess.run(
        [sys.executable, tool, "--rows", "flags,module", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ),
    )
    rows = {row["row"]: row for row in json.loads(out.read_text())}
    for name in ("flags", "module"):
        row = rows[name]
        assert row["fresh"] == ["passed", "passed"], done.stdout  # the reference
        assert row["cpq"] == row["fresh"], done.stdout
    assert done.returncode == 0, done.stdout + done.stderr
