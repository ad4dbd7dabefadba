"""Transformer Engine context-parallel attention matrix, run in warm cpq groups.

Why this exists: it is the workload cpq was built for (TE's ``run_dpa_with_cp``), one test
per case, each case dispatched to a warm world-size-2 group instead of its own torchrun.
The task itself lives in ``workers/te_attention.py``; it skips with TE's reason where TE has
no backend for a configuration on this GPU. Without two GPUs or without Transformer Engine
(CPU CI) the whole module skips.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

if importlib.util.find_spec("transformer_engine") is None:
    pytest.skip("Transformer Engine is not installed", allow_module_level=True)
if torch.cuda.device_count() < 2:
    pytest.skip("needs at least 2 CUDA GPUs", allow_module_level=True)

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # workers/ is a top-level package of the repo, not installed
    sys.path.insert(0, str(_REPO))

from workers.te_attention import CASES, CASES_WS4, case_id  # noqa: E402

TASK = "workers.te_attention:run_dpa_with_cp"
# TE is imported when the group starts (not in the first test), and what its import puts in
# os.environ becomes part of the group's baseline.
TE_GROUP = {"CPQ_PRELOAD": "transformer_engine.pytorch"}


@pytest.mark.cpq(world_size=2, env=TE_GROUP)  # declares the pool: warmed during collection
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_te_cp(cpq: Any, case: dict[str, Any]) -> None:
    cpq.run(TASK, **case)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="a2a+p2p cases need 4 GPUs")
@pytest.mark.cpq(world_size=4, env=TE_GROUP)
@pytest.mark.parametrize("case", CASES_WS4, ids=[case_id(c) for c in CASES_WS4])
def test_te_cp_ws4(cpq: Any, case: dict[str, Any]) -> None:
    cpq.run(TASK, **case)
