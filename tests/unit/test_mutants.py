"""tools/mutants.py keeps applying: every mutant's original line is still in the code once,
and the tests it names exist (running the mutants is `python tools/mutants.py`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("cpq_tools_mutants", ROOT / "tools" / "mutants.py")
assert _spec is not None and _spec.loader is not None
mutants = importlib.util.module_from_spec(_spec)
sys.modules["cpq_tools_mutants"] = mutants  # dataclasses look their module up
_spec.loader.exec_module(mutants)


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name.split(":")[0])
def test_every_mutant_still_applies(mutant: object) -> None:
    assert (ROOT / mutant.path).read_text().count(mutant.original) == 1  # type: ignore[attr-defined]
    for test in mutant.tests:  # type: ignore[attr-defined]
        assert (ROOT / test.split("::")[0]).exists(), test
