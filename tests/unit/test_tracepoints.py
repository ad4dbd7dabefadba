"""``CPQ_TRACE_DIR`` notes (cpq.tracepoints): off, nothing is kept; on, every note reaches
its process's file, in order, with the clock every process of the host shares."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from cpq import tracepoints


def test_off_a_note_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracepoints, "DIR", "")
    monkeypatch.setattr(tracepoints, "_notes", [])
    tracepoints.mark("t1", "client submits")
    assert tracepoints._notes == [] and tracepoints.now() == 0.0


def test_on_every_note_reaches_the_file_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracepoints, "DIR", str(tmp_path))
    monkeypatch.setattr(tracepoints, "_notes", [])
    before = time.perf_counter()
    began = tracepoints.now()
    for i in range(250):  # past one batch of 200: written as it fills, the rest at flush
        tracepoints.mark(f"t{i}", "client sends")
    tracepoints.mark("t0", "client submits", began)
    tracepoints.flush()
    lines = (tmp_path / f"{os.getpid()}.jsonl").read_text().splitlines()
    notes = [note for line in lines for note in json.loads(line)]
    assert [n[0] for n in notes[:250]] == [f"t{i}" for i in range(250)]
    assert notes[-1] == ["t0", "client submits", began]
    assert all(before <= n[2] <= time.perf_counter() for n in notes)
    assert len(lines) == 2 and tracepoints._notes == []
